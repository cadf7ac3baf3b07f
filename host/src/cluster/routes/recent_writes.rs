//! Where this node's latest route records landed in the routes topic, so
//! that the ones a reader never got ([`crate::kafka::tail::TailEvent::Missed`],
//! reported by a peer over the mesh or by this node's own reader) can be
//! written again: a bounded ring of the last [`RECENT_WRITES`] acknowledged
//! records, each with its process and, for a tombstone, the generation it
//! ends.
//!
//! A reader notices a miss within a fetch or two of the write (at the next
//! record of the partition), so the last few seconds of writes are what
//! matters; an older miss is left to anti-entropy.

use std::collections::VecDeque;
use std::sync::Mutex;

/// Records remembered: about 5 s of a node's writes at the pace of a mass
/// registration on tansu (3,000 records/s), in about 1 MiB.
pub(super) const RECENT_WRITES: usize = 16_384;

/// One acknowledged route record of this node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Written {
    /// The process it is about.
    pub(super) process_id: Box<str>,
    /// For a tombstone, the generation of the route it ends; `None` for a
    /// route.
    pub(super) ends: Option<u64>,
}

/// The ring of recent writes.
#[derive(Debug, Default)]
pub(super) struct RecentWrites {
    ring: Mutex<VecDeque<(i32, i64, Written)>>,
}

impl RecentWrites {
    /// Notes that `written` landed at `offset` of `partition`, forgetting
    /// the oldest write when [`RECENT_WRITES`] are held.
    pub(super) fn note(&self, partition: i32, offset: i64, written: Written) {
        let mut ring = self.ring.lock().unwrap_or_else(|e| e.into_inner());
        if ring.len() == RECENT_WRITES {
            ring.pop_front();
        }
        ring.push_back((partition, offset, written));
    }

    /// The writes that landed at offsets `from..to` of `partition`, oldest
    /// first.
    pub(super) fn between(&self, partition: i32, from: i64, to: i64) -> Vec<Written> {
        let ring = self.ring.lock().unwrap_or_else(|e| e.into_inner());
        ring.iter()
            .filter(|(p, offset, _)| *p == partition && (from..to).contains(offset))
            .map(|(_, _, written)| written.clone())
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn route(process: &str) -> Written {
        Written {
            process_id: process.into(),
            ends: None,
        }
    }

    #[test]
    fn the_writes_in_a_range_of_one_partition_are_found() {
        let recent = RecentWrites::default();
        recent.note(0, 10, route("a"));
        recent.note(1, 11, route("b"));
        recent.note(0, 12, route("c"));
        recent.note(
            0,
            13,
            Written {
                process_id: "d".into(),
                ends: Some(7),
            },
        );
        let found = recent.between(0, 11, 14);
        assert_eq!(found.len(), 2);
        assert_eq!(&*found[0].process_id, "c");
        assert_eq!(found[1].ends, Some(7));
        assert!(recent.between(0, 14, 20).is_empty(), "to is exclusive");
        assert_eq!(recent.between(1, 0, 100), vec![route("b")]);
    }

    #[test]
    fn the_oldest_write_is_forgotten_once_the_ring_is_full() {
        let recent = RecentWrites::default();
        for offset in 0..=i64::try_from(RECENT_WRITES).unwrap() {
            recent.note(0, offset, route(&offset.to_string()));
        }
        assert!(recent.between(0, 0, 1).is_empty());
        assert_eq!(recent.between(0, 1, 2), vec![route("1")]);
    }
}
