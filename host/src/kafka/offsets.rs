//! Which input offsets may be committed: per partition, the highest offset
//! below which every consumed message is finished.
//!
//! Messages of one partition finish out of order (a data-return's produce
//! acknowledgement can come after the next message's), so a finished offset
//! is only committable once everything consumed before it is finished too.
//! This module is pure bookkeeping; storing the offset in the consumer is
//! the consumer's job.

use std::collections::BTreeSet;

/// In-flight offsets of one partition.
#[derive(Debug, Default, Clone)]
pub struct PartitionOffsets {
    /// Consumed and not yet finished.
    in_flight: BTreeSet<i64>,
    /// The highest offset consumed so far.
    highest_consumed: Option<i64>,
    /// The last commit position handed out (next offset to consume).
    committed_position: Option<i64>,
}

impl PartitionOffsets {
    /// Records that `offset` was consumed and is now being worked on.
    pub fn consumed(&mut self, offset: i64) {
        // The first record sets where committing starts: nothing before it
        // was consumed here, and nothing at or after it is finished yet.
        self.committed_position.get_or_insert(offset);
        self.in_flight.insert(offset);
        self.highest_consumed = Some(self.highest_consumed.map_or(offset, |h| h.max(offset)));
    }

    /// Records that everything `offset` caused is done. Returns the new
    /// commit position (the next offset to consume: Kafka's convention) when
    /// it moved forward.
    pub fn finished(&mut self, offset: i64) -> Option<i64> {
        if !self.in_flight.remove(&offset) {
            return None;
        }
        let position = match self.in_flight.first() {
            // Everything below the oldest unfinished offset is done.
            Some(oldest) => *oldest,
            None => self.highest_consumed? + 1,
        };
        if self.committed_position.is_some_and(|p| p >= position) {
            return None;
        }
        self.committed_position = Some(position);
        Some(position)
    }

    /// How many consumed messages are not finished yet.
    pub fn in_flight(&self) -> usize {
        self.in_flight.len()
    }

    /// The highest offset consumed so far.
    pub fn highest_consumed(&self) -> Option<i64> {
        self.highest_consumed
    }

    /// The last commit position handed out.
    pub fn committed_position(&self) -> Option<i64> {
        self.committed_position
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commit_position_waits_for_the_oldest_unfinished_offset() {
        let mut p = PartitionOffsets::default();
        for offset in 10..15 {
            p.consumed(offset);
        }
        assert_eq!(p.finished(12), None, "10 and 11 are not finished");
        assert_eq!(p.finished(11), None);
        assert_eq!(p.finished(10), Some(13), "10..=12 done, 13 still in flight");
        assert_eq!(p.finished(14), None, "13 still in flight");
        assert_eq!(p.finished(13), Some(15));
        assert_eq!(p.in_flight(), 0);
    }

    #[test]
    fn gaps_in_offsets_do_not_block_commits() {
        // Compacted topics and transaction markers leave gaps.
        let mut p = PartitionOffsets::default();
        p.consumed(3);
        p.consumed(7);
        assert_eq!(p.finished(3), Some(7));
        assert_eq!(p.finished(7), Some(8));
    }

    #[test]
    fn unknown_or_repeated_finishes_are_ignored() {
        let mut p = PartitionOffsets::default();
        p.consumed(1);
        assert_eq!(p.finished(5), None);
        assert_eq!(p.finished(1), Some(2));
        assert_eq!(p.finished(1), None);
    }

    #[test]
    fn never_moves_backwards() {
        let mut p = PartitionOffsets::default();
        p.consumed(5);
        assert_eq!(p.finished(5), Some(6));
        // A redelivery of an older offset after a rebalance.
        p.consumed(4);
        assert_eq!(p.finished(4), None);
        assert_eq!(p.committed_position(), Some(6));
    }
}
