//! Rejoining the consumer group when another member died: a relay knows a
//! peer is dead (its heartbeats stopped) but the broker decides when the
//! peer's partitions move. Apache Kafka moves them once the dead member's
//! session times out; tansu 0.6.0 evicts the member at that time but never
//! tells the survivors, so its partitions stay assigned to nobody. A
//! survivor that rejoins after the eviction makes the group form again
//! without the dead member, on either broker.
//!
//! [`RejoinSchedule`] is the consumer thread's bookkeeping: told of a lost
//! peer (and when it was last heard), it names the moment the broker must
//! have evicted it (last heard + the session timeout) and asks for one
//! rejoin a heartbeat interval and a margin later. A rejoin is leaving the
//! group and subscribing again: every partition is revoked (drained and
//! committed as in any rebalance) and the consumer joins as a new member.
//! (Subscribing again alone rejoins with the same member id, and tansu
//! answers such a JoinGroup with the generation the member is in.)
//!
//! The rejoin is made even when the group was assigned again after the
//! eviction: tansu 0.6.0 does tell the survivors to rejoin when it evicts a
//! member, but the generation that forms then still hands partitions to
//! the dead member (seen: a survivor of three kept its third). On Apache
//! Kafka this costs one more rebalance per lost peer.
//!
//! Rejoining before the eviction would not help: the dead member would be
//! in the new generation too (tansu), or the join would wait for its
//! session to end with every partition revoked meanwhile (Kafka).

use std::time::{Duration, Instant};

/// The default `session.timeout.ms` of a consumer that rejoins on a lost
/// peer, when the link does not set one: as short as Apache Kafka allows
/// by default (`group.min.session.timeout.ms` = 6 s), so that a dead
/// member's partitions move within seconds, not librdkafka's 45 s.
pub const DEFAULT_SESSION_TIMEOUT: Duration = Duration::from_secs(6);

/// Added after the eviction before rejoining: clocks and the broker's own
/// check of expired sessions.
const MARGIN: Duration = Duration::from_secs(1);

/// A member of the group that stopped beating (not one that left).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PeerLost {
    /// The peer, for the log.
    pub node_id: String,
    /// When its last sign of life arrived here.
    pub last_heard: Instant,
}

/// When a consumer rejoins its group for lost peers.
#[derive(Debug)]
pub struct RejoinSchedule {
    session_timeout: Duration,
    heartbeat_interval: Duration,
    pending: Option<Pending>,
}

#[derive(Debug)]
struct Pending {
    node_id: String,
    /// By when the broker has evicted the dead member.
    evicted_by: Instant,
    rejoin_at: Instant,
}

impl RejoinSchedule {
    /// For a consumer whose session times out after `session_timeout` and
    /// which beats every `heartbeat_interval`.
    pub fn new(session_timeout: Duration, heartbeat_interval: Duration) -> RejoinSchedule {
        RejoinSchedule {
            session_timeout,
            heartbeat_interval,
            pending: None,
        }
    }

    /// A peer was lost. With one already pending, the later eviction wins
    /// (one rejoin after both covers both).
    pub fn peer_lost(&mut self, lost: PeerLost) {
        let evicted_by = lost.last_heard + self.session_timeout;
        if self
            .pending
            .as_ref()
            .is_some_and(|pending| pending.evicted_by >= evicted_by)
        {
            return;
        }
        self.pending = Some(Pending {
            node_id: lost.node_id,
            evicted_by,
            // The broker tells the members at their next heartbeat: give
            // it that long to rebalance on its own first.
            rejoin_at: evicted_by + self.heartbeat_interval + MARGIN,
        });
    }

    /// When the pending rejoin is due, if one is pending.
    pub fn next_due(&self) -> Option<Instant> {
        self.pending.as_ref().map(|pending| pending.rejoin_at)
    }

    /// The lost peer to rejoin for at `now`, once, when its rejoin is due.
    pub fn due(&mut self, now: Instant) -> Option<String> {
        if self.next_due().is_none_or(|at| now < at) {
            return None;
        }
        self.pending.take().map(|pending| pending.node_id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SESSION: Duration = Duration::from_secs(6);
    const HEARTBEAT: Duration = Duration::from_secs(2);

    fn lost(node: &str, last_heard: Instant) -> PeerLost {
        PeerLost {
            node_id: node.to_string(),
            last_heard,
        }
    }

    #[test]
    fn a_lost_peer_is_rejoined_for_once_after_its_eviction_and_a_heartbeat() {
        let start = Instant::now();
        let mut schedule = RejoinSchedule::new(SESSION, HEARTBEAT);
        assert_eq!(schedule.due(start + Duration::from_secs(60)), None);
        schedule.peer_lost(lost("node-c", start));
        let due_at = start + SESSION + HEARTBEAT + MARGIN;
        assert_eq!(schedule.next_due(), Some(due_at));
        assert_eq!(schedule.due(due_at - Duration::from_millis(1)), None);
        assert_eq!(schedule.due(due_at), Some("node-c".to_string()));
        assert_eq!(schedule.due(due_at + Duration::from_secs(1)), None);
    }

    #[test]
    fn two_lost_peers_take_one_rejoin_after_the_later_eviction() {
        let start = Instant::now();
        let mut schedule = RejoinSchedule::new(SESSION, HEARTBEAT);
        schedule.peer_lost(lost("node-b", start + Duration::from_secs(2)));
        schedule.peer_lost(lost("node-c", start));
        let due_at = schedule.next_due().unwrap();
        assert_eq!(
            due_at,
            start + Duration::from_secs(2) + SESSION + HEARTBEAT + MARGIN
        );
        assert_eq!(schedule.due(due_at), Some("node-b".to_string()));
        assert_eq!(schedule.next_due(), None);
    }
}
