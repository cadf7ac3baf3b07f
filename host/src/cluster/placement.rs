//! Placement: which node a new business process should connect to. When a
//! process that follows redirects says Hello, the node asks this policy and
//! either accepts the process or redirects it (see `gateway::admit`).
//!
//! The built-in rule picks, among the live nodes that are not leaving or
//! being evacuated and are below their connection quota, the one with the lowest share of its
//! quota in use, so connections spread in proportion to the quotas; a tie
//! goes to this node (no redirect), then to the smaller node id. A node's
//! connections are those of its last heartbeat plus the processes this node
//! placed on it since that heartbeat was sent (heartbeats are seconds
//! apart; a burst of Hellos must not all go to the same node). The flow's
//! router plugin, when it has one, decides first through its `place`
//! export; an answer naming a live node with room is followed, anything
//! else (no answer, an unknown or full node, a failure) falls back to the
//! built-in rule.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use futures::FutureExt as _;
use futures::future::BoxFuture;
use tokio::sync::watch;

use super::membership::ClusterView;
use super::router::ProcessRouter;
use crate::gateway::{Placement, PlacementPolicy};

/// One candidate node's load.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeLoad {
    /// The node.
    pub node_id: String,
    /// Where processes connect to it.
    pub client_addr: String,
    /// Processes it holds (as far as this node knows).
    pub connections: u64,
    /// Processes it may hold.
    pub quota: u64,
}

impl NodeLoad {
    fn has_room(&self) -> bool {
        self.connections < self.quota
    }

    /// Node `id` (clients at `id:7400`) holding `connections` of `quota`:
    /// the loads of the placement and rebalancing tests.
    #[cfg(test)]
    pub(crate) fn of_test_node(id: &str, connections: u64, quota: u64) -> NodeLoad {
        NodeLoad {
            node_id: id.to_string(),
            client_addr: format!("{id}:7400"),
            connections,
            quota,
        }
    }
}

/// The built-in choice among `loads`: the node with room and the lowest
/// share of its quota in use; a tie goes to `self_id`, then to the smaller
/// id. `None` when no node has room.
pub fn least_loaded<'a>(loads: &'a [NodeLoad], self_id: &str) -> Option<&'a NodeLoad> {
    loads.iter().filter(|l| l.has_room()).min_by(|a, b| {
        // a.connections / a.quota  vs  b.connections / b.quota, exactly.
        let left = u128::from(a.connections) * u128::from(b.quota);
        let right = u128::from(b.connections) * u128::from(a.quota);
        left.cmp(&right)
            .then_with(|| (a.node_id != self_id).cmp(&(b.node_id != self_id)))
            .then_with(|| a.node_id.cmp(&b.node_id))
    })
}

/// Processes placed on a node since its heartbeat of `sent_at_ms`.
#[derive(Clone, Copy, Debug, Default)]
struct PlacedSince {
    sent_at_ms: i64,
    count: u64,
}

/// The cluster's placement policy (see the module doc).
pub struct ClusterPlacement {
    self_id: String,
    self_addr: String,
    quota: u64,
    view: watch::Receiver<ClusterView>,
    router: Option<ProcessRouter>,
    placed: Arc<Mutex<HashMap<String, PlacedSince>>>,
    /// Set while this node is being evacuated: it is no candidate then.
    evacuating: Arc<AtomicBool>,
}

impl std::fmt::Debug for ClusterPlacement {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterPlacement")
            .field("self_id", &self.self_id)
            .field("quota", &self.quota)
            .finish_non_exhaustive()
    }
}

impl ClusterPlacement {
    /// The policy of node `self_id` (client address `self_addr`, quota
    /// `quota`) over the cluster `view`, asking `router`'s plugin first
    /// when it has one.
    pub fn new(
        self_id: &str,
        self_addr: &str,
        quota: u64,
        view: watch::Receiver<ClusterView>,
        router: Option<ProcessRouter>,
    ) -> ClusterPlacement {
        ClusterPlacement {
            self_id: self_id.to_string(),
            self_addr: self_addr.to_string(),
            quota,
            view,
            router: router.filter(ProcessRouter::has_plugin),
            placed: Arc::new(Mutex::new(HashMap::new())),
            evacuating: Arc::new(AtomicBool::new(false)),
        }
    }

    /// This policy, leaving this node out while `evacuating` is set (the
    /// gateway's flag, see `Gateway::evacuating_flag`).
    pub fn with_evacuating(mut self, evacuating: Arc<AtomicBool>) -> ClusterPlacement {
        self.evacuating = evacuating;
        self
    }

    /// The candidates now: this node with its own count (unless it is
    /// being evacuated), and every other live node that is not leaving or
    /// being evacuated, with its heartbeat's count plus what
    /// was placed on it since.
    fn loads(&self, local_connections: usize) -> Vec<NodeLoad> {
        let view = self.view.borrow();
        let mut placed = self.placed.lock().unwrap_or_else(|e| e.into_inner());
        placed.retain(|id, _| view.is_live(id));
        let mut loads = Vec::with_capacity(view.nodes.len() + 1);
        if !self.evacuating.load(Ordering::SeqCst) {
            loads.push(NodeLoad {
                node_id: self.self_id.clone(),
                client_addr: self.self_addr.clone(),
                connections: local_connections as u64,
                quota: self.quota,
            });
        }
        for node in view.nodes.values() {
            let beat = &node.heartbeat;
            if !node.live || beat.leaving || beat.evacuating || beat.node_id == self.self_id {
                continue;
            }
            let since = placed.entry(beat.node_id.clone()).or_default();
            if since.sent_at_ms != beat.sent_at_ms {
                // A newer heartbeat counts what was placed before it.
                *since = PlacedSince {
                    sent_at_ms: beat.sent_at_ms,
                    count: 0,
                };
            }
            loads.push(NodeLoad {
                node_id: beat.node_id.clone(),
                client_addr: beat.client_addr.clone(),
                connections: beat.connections + since.count,
                quota: beat.quota,
            });
        }
        loads
    }

    fn full(loads: &[NodeLoad]) -> Placement {
        let total: u64 = loads.iter().map(|l| l.connections).sum();
        let quota: u64 = loads.iter().map(|l| l.quota).sum();
        Placement::Full(format!(
            "every live node is at its connection quota ({} nodes, {total} of {quota} connections); \
             connect again later",
            loads.len()
        ))
    }
}

/// Places on `chosen`: here, or a redirect counted against that node in
/// `placed`.
fn place_on(
    chosen: &NodeLoad,
    self_id: &str,
    placed: &Mutex<HashMap<String, PlacedSince>>,
) -> Placement {
    if chosen.node_id == self_id {
        return Placement::Here;
    }
    if let Some(since) = placed
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get_mut(&chosen.node_id)
    {
        since.count += 1;
    }
    Placement::Elsewhere {
        node_id: chosen.node_id.clone(),
        address: chosen.client_addr.clone(),
    }
}

/// What the router plugin's answer `answer` comes to, given `loads`: its
/// node when that one is live with room, else `None` (logged).
fn plugin_choice(answer: Result<Option<String>, String>, loads: &[NodeLoad]) -> Option<&NodeLoad> {
    let node_id = match answer {
        Ok(Some(node_id)) => node_id,
        Ok(None) => return None,
        Err(reason) => {
            tracing::warn!(%reason, "the router plugin's place failed; placing the process by the built-in rule");
            return None;
        }
    };
    match loads.iter().find(|l| l.node_id == node_id) {
        Some(load) if load.has_room() => Some(load),
        Some(_) => {
            tracing::warn!(node = %node_id, "the router plugin placed a process on a full node; placing it by the built-in rule");
            None
        }
        None => {
            tracing::warn!(node = %node_id, "the router plugin placed a process on a node that is not live; placing it by the built-in rule");
            None
        }
    }
}

impl PlacementPolicy for ClusterPlacement {
    fn place(&self, process_id: &str, local_connections: usize) -> BoxFuture<'static, Placement> {
        let loads = self.loads(local_connections);
        let self_id = self.self_id.clone();
        let placed = self.placed.clone();
        let router = self.router.clone();
        let process_id = process_id.to_string();
        async move {
            // The plugin's answer is checked against the loads taken
            // before asking it.
            let from_plugin = match &router {
                Some(router) => plugin_choice(router.place(&process_id, &loads).await, &loads),
                None => None,
            };
            match from_plugin.or_else(|| least_loaded(&loads, &self_id)) {
                Some(chosen) => place_on(chosen, &self_id, &placed),
                None => ClusterPlacement::full(&loads),
            }
        }
        .boxed()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::membership::{Heartbeat, NodeView};

    fn load(id: &str, connections: u64, quota: u64) -> NodeLoad {
        NodeLoad::of_test_node(id, connections, quota)
    }

    #[test]
    fn the_node_with_the_lowest_share_of_its_quota_in_use_is_chosen() {
        let loads = [load("a", 500, 1000), load("b", 260, 500), load("c", 10, 20)];
        // 50%, 52%, 50%: a tie between a and c goes to this node, else to
        // the smaller id.
        assert_eq!(least_loaded(&loads, "c").unwrap().node_id, "c");
        assert_eq!(least_loaded(&loads, "b").unwrap().node_id, "a");
        let loads = [load("a", 0, 1000), load("b", 0, 500)];
        assert_eq!(least_loaded(&loads, "b").unwrap().node_id, "b");
        assert_eq!(least_loaded(&loads, "x").unwrap().node_id, "a");
    }

    #[test]
    fn full_nodes_are_never_chosen() {
        let loads = [load("a", 1000, 1000), load("b", 499, 500)];
        assert_eq!(least_loaded(&loads, "a").unwrap().node_id, "b");
        let loads = [load("a", 1000, 1000), load("b", 500, 500), load("c", 0, 0)];
        assert_eq!(least_loaded(&loads, "a"), None);
    }

    #[test]
    fn placing_in_turn_fills_nodes_in_proportion_to_their_quotas() {
        let mut loads = vec![load("a", 0, 1000), load("b", 0, 1000), load("c", 0, 500)];
        let place = |loads: &mut Vec<NodeLoad>, processes: usize| {
            for _ in 0..processes {
                let chosen = least_loaded(loads, "a").unwrap().node_id.clone();
                let node = loads.iter_mut().find(|l| l.node_id == chosen).unwrap();
                node.connections += 1;
            }
        };
        place(&mut loads, 2000);
        let counts: Vec<u64> = loads.iter().map(|l| l.connections).collect();
        assert_eq!(counts, vec![800, 800, 400]);
        place(&mut loads, 500);
        assert_eq!(least_loaded(&loads, "a"), None, "{loads:?}");
    }

    fn view(nodes: &[(&str, u64, u64, i64, bool)]) -> ClusterView {
        let mut view = ClusterView::default();
        for &(id, connections, quota, sent_at_ms, live) in nodes {
            view.nodes.insert(
                id.to_string(),
                NodeView {
                    heartbeat: Heartbeat {
                        node_id: id.to_string(),
                        instance_id: "i".to_string(),
                        client_addr: format!("{id}:7400"),
                        mesh_addr: format!("{id}:7401"),
                        admin_addr: format!("{id}:9464"),
                        connections,
                        quota,
                        started_at_ms: 0,
                        sent_at_ms,
                        leaving: false,
                        evacuating: false,
                    },
                    live,
                    last_seen_ms_ago: 0,
                },
            );
        }
        view.live = view.nodes.values().filter(|n| n.live).count();
        view
    }

    #[tokio::test]
    async fn redirects_count_against_a_node_until_its_next_heartbeat() {
        let (tx, rx) = watch::channel(view(&[
            ("a", 0, 10, 1, true),
            ("b", 0, 10, 1, true),
            ("dead", 0, 100, 1, false),
        ]));
        let policy = ClusterPlacement::new("a", "a:7400", 10, rx, None);
        // This node holds 3: b (0 + placed) takes the next three.
        for n in 0..3 {
            let placed = policy.place(&format!("p-{n}"), 3).await;
            assert_eq!(
                placed,
                Placement::Elsewhere {
                    node_id: "b".to_string(),
                    address: "b:7400".to_string()
                }
            );
        }
        assert_eq!(policy.place("p-3", 3).await, Placement::Here);
        // b's next heartbeat reports the three: the count starts again.
        tx.send(view(&[("a", 3, 10, 2, true), ("b", 3, 10, 2, true)]))
            .unwrap();
        assert_eq!(policy.place("p-4", 3).await, Placement::Here);
        assert!(matches!(
            policy.place("p-5", 4).await,
            Placement::Elsewhere { .. }
        ));
        // Everyone full: refused with the totals.
        tx.send(view(&[("a", 10, 10, 3, true), ("b", 10, 10, 3, true)]))
            .unwrap();
        let Placement::Full(reason) = policy.place("p-6", 10).await else {
            panic!("placed on a full cluster");
        };
        assert!(reason.contains("20 of 20"), "{reason}");
    }
}
