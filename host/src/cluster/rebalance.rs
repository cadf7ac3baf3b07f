//! Rebalancing: moving processes off a node that holds more than its share,
//! and evacuating a node for maintenance.
//!
//! Every node judges only itself, from its own count and the others'
//! heartbeats (the [`ClusterView`]): its *share* is the cluster's
//! connections split in proportion to the connection quotas. It is
//! *overloaded* when its count exceeds the share by more than
//! `rebalance_threshold_percent` of it and by at least
//! `rebalance_min_excess` connections. An overloaded node starts a round: it
//! tells its processes, one by one and at most `rebalance_rate` per second,
//! to reconnect to the least-loaded other node (by the same rule as
//! placement, [`least_loaded`]), with a `Rebalance` frame naming that node's
//! client address, and re-evaluates before every move. The round ends once
//! the count is within half of `rebalance_min_excess` of the share, so a
//! node does not stay at the edge of the condition (hysteresis), nor move a
//! process to a node that would then hold a larger share than this one.
//! Moves made since a node's last heartbeat are counted against it, as
//! placement counts redirects, so a burst does not all land on one node.
//!
//! A moved process's unanswered deliveries are not lost: ending its session
//! resolves them as lost (`Session::fail_pending`) and the cluster delivery
//! retries them, with the same delivery id, wherever the process
//! reconnects; nothing is dead-lettered while it reconnects within the TTL.
//!
//! `POST /rebalance` starts a round at once (when the condition holds);
//! `POST /evacuate` marks the node as evacuating (its gateway accepts no
//! new process, its heartbeats say so and other nodes stop placing on it)
//! and moves every process off it at the rebalance rate or a given higher
//! one, until it holds none; it stays evacuating until it stops.
//!
//! Owns: the condition, the pacing and the choice of process and target.
//! Does not own: how a session ends ([`crate::gateway::Session`]), the
//! placement of new processes ([`super::placement`]) nor redelivery
//! ([`super::delivery`]).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use serde_json::json;
use tokio::sync::{Notify, watch};
use tokio_util::sync::CancellationToken;

use super::membership::ClusterView;
use super::placement::{NodeLoad, least_loaded};
use crate::gateway::{Gateway, Session};
use crate::telemetry::metrics::ClusterMetrics;

/// How long moves are remembered to be counted against their target
/// until its heartbeat shows them.
const MOVES_REMEMBERED_MS: i64 = 30_000;

/// When and how fast a node rebalances (from `[cluster]`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RebalanceOptions {
    /// Whether the node checks the condition on its own.
    pub automatic: bool,
    /// Overloaded beyond this percentage over the share...
    pub threshold_percent: u32,
    /// ... and at least this many connections over it.
    pub min_excess: u64,
    /// Moves per second at most.
    pub rate: u32,
    /// How often the condition is checked.
    pub interval: Duration,
}

impl Default for RebalanceOptions {
    fn default() -> Self {
        RebalanceOptions {
            automatic: true,
            threshold_percent: 10,
            min_excess: 10,
            rate: 50,
            interval: Duration::from_secs(5),
        }
    }
}

impl RebalanceOptions {
    /// Whether `count` connections against a share of `share` meet the
    /// imbalance condition (start a round).
    pub fn overloaded(&self, count: u64, share: u64) -> bool {
        let excess = count.saturating_sub(share);
        excess >= self.min_excess.max(1)
            && u128::from(excess) * 100 > u128::from(share) * u128::from(self.threshold_percent)
    }

    /// Whether a round under way goes on: the count is still more than
    /// half of `min_excess` over the share.
    pub fn keeps_moving(&self, count: u64, share: u64) -> bool {
        count.saturating_sub(share) > self.min_excess / 2
    }
}

/// This node's share of the cluster's connections in `loads` (every node
/// counted; `self_id` among them), in proportion to the quotas; `None`
/// when nobody has a quota.
pub fn share_of(loads: &[NodeLoad], self_id: &str) -> Option<u64> {
    let total: u128 = loads.iter().map(|l| u128::from(l.connections)).sum();
    let quotas: u128 = loads.iter().map(|l| u128::from(l.quota)).sum();
    let own = loads.iter().find(|l| l.node_id == self_id)?;
    if quotas == 0 {
        return None;
    }
    // Rounded to the nearest connection.
    let share = (total * u128::from(own.quota) + quotas / 2) / quotas;
    Some(u64::try_from(share).unwrap_or(u64::MAX))
}

/// Where to move one process of `self_id` (holding `count`, quota
/// `quota`): the least-loaded other candidate in `targets`, if it would
/// still hold a smaller share of its quota than this node after the move.
pub fn move_target<'a>(
    targets: &'a [NodeLoad],
    self_id: &str,
    count: u64,
    quota: u64,
) -> Option<&'a NodeLoad> {
    let others: Vec<NodeLoad> = targets
        .iter()
        .filter(|t| t.node_id != self_id)
        .cloned()
        .collect();
    let chosen = least_loaded(&others, self_id)?;
    // (chosen + 1) / chosen.quota < (count - 1) / quota, exactly.
    let after_there = u128::from(chosen.connections + 1) * u128::from(quota.max(1));
    let after_here = u128::from(count.saturating_sub(1)) * u128::from(chosen.quota);
    if quota != 0 && after_there >= after_here {
        return None;
    }
    targets.iter().find(|t| t.node_id == chosen.node_id)
}

/// What `/cluster` shows of rebalancing, and what the admin API starts.
#[derive(Debug)]
pub struct Rebalancer {
    node_id: String,
    quota: u64,
    options: RebalanceOptions,
    gateway: Arc<Gateway>,
    view: watch::Receiver<ClusterView>,
    metrics: ClusterMetrics,
    /// Wakes the loop for a round now (admin) or an evacuation.
    wake: Notify,
    running: AtomicBool,
    evacuation_rate: AtomicU32,
    rebalance_moves: AtomicU64,
    evacuation_moves: AtomicU64,
    first_move_ms: AtomicI64,
    last_move_ms: AtomicI64,
    /// Moves made recently: (target node, when, ms since the epoch).
    moves: std::sync::Mutex<Vec<(String, i64)>>,
}

/// What a round is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    Rebalance,
    Evacuate,
}

impl Rebalancer {
    /// The rebalancer of node `node_id` (quota `quota`), whose processes
    /// are in `gateway`, over the cluster `view`.
    pub fn new(
        node_id: &str,
        quota: u64,
        options: RebalanceOptions,
        gateway: Arc<Gateway>,
        view: watch::Receiver<ClusterView>,
        metrics: ClusterMetrics,
    ) -> Arc<Rebalancer> {
        Arc::new(Rebalancer {
            node_id: node_id.to_string(),
            quota,
            evacuation_rate: AtomicU32::new(options.rate),
            options,
            gateway,
            view,
            metrics,
            wake: Notify::new(),
            running: AtomicBool::new(false),
            rebalance_moves: AtomicU64::new(0),
            evacuation_moves: AtomicU64::new(0),
            first_move_ms: AtomicI64::new(0),
            last_move_ms: AtomicI64::new(0),
            moves: std::sync::Mutex::new(Vec::new()),
        })
    }

    /// Starts a round now if the condition holds (`POST /rebalance`);
    /// returns the state as [`Rebalancer::json`] shows it, with whether
    /// this node is overloaded now.
    pub fn start_round(&self) -> serde_json::Value {
        self.wake.notify_one();
        let (count, share) = self.balance();
        let mut state = self.json();
        state["overloaded"] = json!(share.is_some_and(|s| self.options.overloaded(count, s)));
        state["share"] = json!(share);
        state
    }

    /// Marks the node as evacuating and moves every process off it, at
    /// `rate` per second (at least the configured rate).
    pub fn evacuate(&self, rate: Option<u32>) -> serde_json::Value {
        let rate = rate.unwrap_or(self.options.rate).max(self.options.rate);
        self.evacuation_rate.store(rate, Ordering::SeqCst);
        self.gateway.set_evacuating(true);
        tracing::warn!(node = %self.node_id, rate, "evacuating: accepting no new process and moving every process to other nodes");
        self.wake.notify_one();
        self.json()
    }

    /// What `/cluster` shows under `rebalance`.
    pub fn json(&self) -> serde_json::Value {
        json!({
            "running": self.running.load(Ordering::SeqCst),
            "evacuating": self.gateway.evacuating(),
            "automatic": self.options.automatic,
            "threshold_percent": self.options.threshold_percent,
            "min_excess": self.options.min_excess,
            "rate": self.options.rate,
            "evacuation_rate": self.evacuation_rate.load(Ordering::SeqCst),
            "rebalance_moves": self.rebalance_moves.load(Ordering::SeqCst),
            "evacuation_moves": self.evacuation_moves.load(Ordering::SeqCst),
            "first_move_at_ms": self.first_move_ms.load(Ordering::SeqCst),
            "last_move_at_ms": self.last_move_ms.load(Ordering::SeqCst),
        })
    }

    /// Checks the condition every interval (when automatic) and on every
    /// wake, running rounds, until `stop`.
    pub async fn run(self: Arc<Self>, stop: CancellationToken) {
        loop {
            tokio::select! {
                () = stop.cancelled() => return,
                () = self.wake.notified() => {}
                () = tokio::time::sleep(self.options.interval), if self.options.automatic => {}
                () = std::future::pending::<()>(), if !self.options.automatic => {}
            }
            let mode = if self.gateway.evacuating() {
                Mode::Evacuate
            } else {
                Mode::Rebalance
            };
            let due = match mode {
                Mode::Evacuate => self.gateway.connection_count() > 0,
                Mode::Rebalance => {
                    let (count, share) = self.balance();
                    share.is_some_and(|share| self.options.overloaded(count, share))
                }
            };
            if due {
                self.round(mode, &stop).await;
            }
        }
    }

    /// One round of paced moves in `mode`, until it is no longer needed,
    /// the mode changes or `stop`.
    async fn round(&self, mode: Mode, stop: &CancellationToken) {
        let rate = match mode {
            Mode::Rebalance => self.options.rate,
            Mode::Evacuate => self.evacuation_rate.load(Ordering::SeqCst),
        };
        self.running.store(true, Ordering::SeqCst);
        self.metrics.rebalancing.set(1);
        let (count, share) = self.balance();
        tracing::info!(node = %self.node_id, ?mode, count, ?share, rate, "moving processes to other nodes");
        let mut pace = tokio::time::interval(Duration::from_secs(1) / rate.max(1));
        pace.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // Sessions to move, best last (fewest unanswered deliveries), and
        // those told to go that are still registered.
        let mut queue: Vec<Arc<Session>> = Vec::new();
        let mut leaving: Vec<Arc<Session>> = Vec::new();
        loop {
            tokio::select! {
                () = stop.cancelled() => break,
                _ = pace.tick() => {}
            }
            if (mode == Mode::Evacuate) != self.gateway.evacuating() {
                // An evacuation began (or ended): the next round has its rate.
                self.wake.notify_one();
                break;
            }
            leaving.retain(|s| self.still_here(s));
            let count =
                (self.gateway.connection_count() as u64).saturating_sub(leaving.len() as u64);
            let targets = self.targets();
            let target = match mode {
                Mode::Evacuate => {
                    if count == 0 {
                        break;
                    }
                    let others: Vec<NodeLoad> = targets
                        .iter()
                        .filter(|t| t.node_id != self.node_id)
                        .cloned()
                        .collect();
                    least_loaded(&others, &self.node_id).cloned()
                }
                Mode::Rebalance => {
                    let Some(share) = share_of(&self.all_loads(count), &self.node_id) else {
                        break;
                    };
                    if !self.options.keeps_moving(count, share) {
                        break;
                    }
                    match move_target(&targets, &self.node_id, count, self.quota) {
                        Some(target) => Some(target.clone()),
                        None => break,
                    }
                }
            };
            // No other node has room: wait for one.
            let Some(target) = target else { continue };
            let Some(session) = self.next_session(&mut queue) else {
                continue;
            };
            let reason = match mode {
                Mode::Rebalance => format!(
                    "rebalancing: node {} holds {count} processes, more than its share; node {} has room",
                    self.node_id, target.node_id
                ),
                Mode::Evacuate => format!(
                    "node {} is being evacuated; node {} has room",
                    self.node_id, target.node_id
                ),
            };
            tracing::debug!(process = %session.process_id(), target = %target.node_id, "moving a process");
            session.rebalance(vec![target.client_addr.clone()], reason);
            leaving.push(session);
            self.count_move(mode, &target.node_id);
        }
        self.running.store(false, Ordering::SeqCst);
        self.metrics.rebalancing.set(0);
        let (count, share) = self.balance();
        tracing::info!(node = %self.node_id, ?mode, count, ?share, "done moving processes");
    }

    /// Whether `session` is still the registered one of its process.
    fn still_here(&self, session: &Arc<Session>) -> bool {
        self.gateway
            .session(session.process_id())
            .is_some_and(|s| s.connection_id() == session.connection_id())
    }

    /// The next process to move: not ending, still registered; the queue
    /// is filled again from the gateway when it runs dry.
    fn next_session(&self, queue: &mut Vec<Arc<Session>>) -> Option<Arc<Session>> {
        for refill in [false, true] {
            if refill {
                let mut sessions = self.gateway.sessions();
                sessions.sort_by_key(|s| std::cmp::Reverse(s.unacked()));
                *queue = sessions;
            }
            while let Some(session) = queue.pop() {
                if !session.is_ending() && self.still_here(&session) {
                    return Some(session);
                }
            }
        }
        None
    }

    fn count_move(&self, mode: Mode, target: &str) {
        let now = super::now_ms();
        match mode {
            Mode::Rebalance => {
                self.rebalance_moves.fetch_add(1, Ordering::SeqCst);
                self.metrics.rebalance_moves.inc();
            }
            Mode::Evacuate => {
                self.evacuation_moves.fetch_add(1, Ordering::SeqCst);
                self.metrics.evacuation_moves.inc();
            }
        }
        let _ = self
            .first_move_ms
            .compare_exchange(0, now, Ordering::SeqCst, Ordering::SeqCst);
        self.last_move_ms.store(now, Ordering::SeqCst);
        let mut moves = self.moves.lock().unwrap_or_else(|e| e.into_inner());
        moves.retain(|(_, at)| now - at < MOVES_REMEMBERED_MS);
        moves.push((target.to_string(), now));
    }

    /// This node's count and share now.
    fn balance(&self) -> (u64, Option<u64>) {
        let count = self.gateway.connection_count() as u64;
        (count, share_of(&self.all_loads(count), &self.node_id))
    }

    /// Every live node that holds connections, this one with `count` (an
    /// evacuating node with no quota: its share is nothing), with the
    /// moves made to it since its last heartbeat.
    fn all_loads(&self, count: u64) -> Vec<NodeLoad> {
        let evacuating = self.gateway.evacuating();
        let mut loads = self.peer_loads(true);
        loads.push(NodeLoad {
            node_id: self.node_id.clone(),
            client_addr: String::new(),
            connections: count,
            quota: if evacuating { 0 } else { self.quota },
        });
        loads
    }

    /// The nodes processes may move to: live, not leaving nor evacuating.
    fn targets(&self) -> Vec<NodeLoad> {
        self.peer_loads(false)
    }

    fn peer_loads(&self, with_evacuating: bool) -> Vec<NodeLoad> {
        let view = self.view.borrow();
        let moves = self.moves.lock().unwrap_or_else(|e| e.into_inner());
        view.nodes
            .values()
            .filter(|n| n.live && !n.heartbeat.leaving && n.heartbeat.node_id != self.node_id)
            .filter(|n| with_evacuating || !n.heartbeat.evacuating)
            .map(|n| {
                let beat = &n.heartbeat;
                let since = moves
                    .iter()
                    .filter(|(to, at)| *to == beat.node_id && *at >= beat.sent_at_ms)
                    .count() as u64;
                NodeLoad {
                    node_id: beat.node_id.clone(),
                    client_addr: beat.client_addr.clone(),
                    connections: beat.connections + since,
                    quota: if beat.evacuating { 0 } else { beat.quota },
                }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load(id: &str, connections: u64, quota: u64) -> NodeLoad {
        NodeLoad::of_test_node(id, connections, quota)
    }

    #[test]
    fn the_share_follows_the_quotas() {
        let loads = [
            load("a", 1000, 1000),
            load("b", 1000, 1000),
            load("c", 0, 500),
        ];
        assert_eq!(share_of(&loads, "a"), Some(800));
        assert_eq!(share_of(&loads, "c"), Some(400));
        assert_eq!(share_of(&[load("a", 5, 0)], "a"), None);
        assert_eq!(share_of(&loads, "x"), None);
    }

    #[test]
    fn a_node_is_overloaded_beyond_ten_percent_and_the_minimum_excess() {
        let options = RebalanceOptions::default();
        // Share 750: 825 is 10% over exactly, not more.
        assert!(!options.overloaded(825, 750));
        assert!(options.overloaded(826, 750));
        // 10% of 50 is 5, but the minimum excess is 10.
        assert!(!options.overloaded(59, 50));
        assert!(options.overloaded(60, 50));
        // Below its share: never.
        assert!(!options.overloaded(0, 750));
        assert!(!options.overloaded(700, 750));
        // A node with no share (evacuating, or an empty cluster) and at
        // least the minimum is overloaded.
        assert!(options.overloaded(10, 0));
        assert!(!options.overloaded(9, 0));
    }

    #[test]
    fn a_round_goes_on_until_the_count_is_near_the_share() {
        let options = RebalanceOptions::default();
        assert!(options.keeps_moving(826, 750));
        assert!(options.keeps_moving(760, 750));
        assert!(options.keeps_moving(756, 750));
        assert!(!options.keeps_moving(755, 750));
        assert!(!options.keeps_moving(700, 750));
    }

    #[test]
    fn processes_move_to_the_least_loaded_node_that_stays_below_this_one() {
        // Three nodes of 1000, a fourth joins empty.
        let targets = [
            load("b", 1000, 1000),
            load("c", 1000, 1000),
            load("d", 0, 1000),
        ];
        assert_eq!(move_target(&targets, "a", 1000, 1000).unwrap().node_id, "d");
        // Never to a node that would then hold a larger share than this one.
        let targets = [load("b", 800, 1000)];
        assert_eq!(move_target(&targets, "a", 801, 1000), None);
        assert_eq!(move_target(&targets, "a", 803, 1000).unwrap().node_id, "b");
        // A full node is no target.
        let targets = [load("b", 100, 100)];
        assert_eq!(move_target(&targets, "a", 5000, 1000), None);
    }

    /// The rounds as the nodes would run them, one move at a time with a
    /// view that is exact: 3 × 1000, a fourth node joins; the donors end
    /// within the condition and the newcomer near its share.
    #[test]
    fn three_full_nodes_and_a_new_one_even_out() {
        let options = RebalanceOptions::default();
        let mut counts = [1000u64, 1000, 1000, 0];
        let ids = ["a", "b", "c", "d"];
        let mut moves = 0;
        loop {
            let mut moved = false;
            for i in 0..4 {
                let loads: Vec<NodeLoad> = (0..4).map(|j| load(ids[j], counts[j], 1000)).collect();
                let share = share_of(&loads, ids[i]).unwrap();
                if !options.keeps_moving(counts[i], share) {
                    continue;
                }
                if let Some(target) = move_target(&loads, ids[i], counts[i], 1000) {
                    let j = ids.iter().position(|id| *id == target.node_id).unwrap();
                    counts[i] -= 1;
                    counts[j] += 1;
                    moves += 1;
                    moved = true;
                }
            }
            if !moved {
                break;
            }
        }
        for count in counts {
            assert!(!options.overloaded(count, 750), "{counts:?}");
        }
        assert!(counts[3] >= 730, "{counts:?}");
        assert!(moves <= 750, "{moves} moves");
    }

    #[tokio::test(start_paused = true)]
    async fn pacing_moves_at_most_the_rate_per_second() {
        // The round's pacing: one move per tick of 1 s / rate.
        let rate = 50u32;
        let mut pace = tokio::time::interval(Duration::from_secs(1) / rate);
        pace.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let start = tokio::time::Instant::now();
        let mut ticks = 0;
        while start.elapsed() < Duration::from_secs(2) {
            pace.tick().await;
            ticks += 1;
        }
        assert!(ticks <= 2 * rate + 1, "{ticks} moves in 2 s");
    }
}
