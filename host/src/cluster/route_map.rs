//! The storage of the route table ([`super::routes::RouteTable`]): compact
//! and sharded, so that a node holds a million routes in well under 100
//! bytes each and lookups from many connection tasks do not contend.
//!
//! - Node names are interned in a [`NodeTable`]: a route holds a `u32` id.
//!   Ids are never reused (a name forgotten and seen again gets a new one),
//!   so an id read from a route names the same node in any snapshot of the
//!   names that has it. Each name counts the routes that use it (and the
//!   ones about to be stored), and is forgotten once it has none left.
//!   Lookups read the names from a snapshot (`ArcSwap`), without a lock.
//! - Routes live in [`SHARDS`] shards (a `RwLock` each), the shard chosen by
//!   a hash of the process id: a lookup takes one shard's read lock. The
//!   hashes are foldhash's, seeded at random per map (a few times faster
//!   than SipHash on short keys; the keys are process ids of authenticated
//!   clients and MAC'd records, not any stranger's input).
//! - A route is 20 bytes with alignment 1 (the generation, the place in the
//!   topic and the node id, as bytes), and a process id of up to
//!   [`INLINE_KEY`] bytes is stored inline (16 bytes); a map entry is then
//!   36 bytes without padding, and no key has a heap allocation of its own.
//!   Longer process ids go to a second map of the shard, keyed by
//!   `Box<str>`.
//! - The place of a record in the topic (partition, offset) is packed into
//!   a `u64` that orders as the pair does: 16 bits of partition (+1, so that
//!   0 is a route learned from a lookup, below every record) and 48 bits of
//!   offset. Partitions above 65,534 and offsets above 2^48 (281 trillion
//!   records) saturate.

use std::collections::{HashMap, HashSet};
use std::hash::BuildHasher as _;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

/// The number of shards of the route map (a power of two).
pub(super) const SHARDS: usize = 64;

/// The longest process id stored inline, bytes.
pub(super) const INLINE_KEY: usize = 15;

/// Routes reserved room for at most, however large the topic (its records
/// count routes replaced and tombstones too until compaction); the map
/// grows past it as needed.
const MAX_RESERVE: usize = 4_000_000;

/// The hasher of the maps and of the choice of shard.
type RandomState = foldhash::fast::RandomState;

/// The interned name of a node.
pub(super) type NodeId = u32;

/// A route: the node holding a process, and the order of the record that
/// said so (generation, then place in the topic).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Route {
    pub(super) node: NodeId,
    pub(super) generation: u64,
    /// [`place`] of the record; 0 for a route learned from a lookup.
    pub(super) at: u64,
}

impl Route {
    /// Orders the routes of one process: larger is newer.
    pub(super) fn order(&self) -> (u64, u64) {
        (self.generation, self.at)
    }

    /// True for a route learned from a lookup, not read from the topic.
    pub(super) fn learned(&self) -> bool {
        self.at == 0
    }
}

/// The place of a record in the topic as one `u64` that orders as
/// `(partition, offset)` does; `None` (a learned route) is 0.
pub(super) fn place(record: Option<(i32, i64)>) -> u64 {
    const OFFSET_BITS: u32 = 48;
    let Some((partition, offset)) = record else {
        return 0;
    };
    let partition = u64::try_from(partition.clamp(0, 0xFFFE)).unwrap_or_default() + 1;
    let offset = u64::try_from(offset.max(0))
        .unwrap_or_default()
        .min((1 << OFFSET_BITS) - 1);
    (partition << OFFSET_BITS) | offset
}

/// A process id of up to [`INLINE_KEY`] bytes, and its length.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct InlineKey([u8; INLINE_KEY + 1]);

impl InlineKey {
    fn new(key: &str) -> Option<InlineKey> {
        let bytes = key.as_bytes();
        if bytes.len() > INLINE_KEY {
            return None;
        }
        let mut inline = [0; INLINE_KEY + 1];
        inline[..bytes.len()].copy_from_slice(bytes);
        inline[INLINE_KEY] = u8::try_from(bytes.len()).unwrap_or_default();
        Some(InlineKey(inline))
    }
}

/// A [`Route`] as stored: bytes, so that an entry has no padding.
#[derive(Clone, Copy, Debug)]
struct Slot {
    generation: [u8; 8],
    at: [u8; 8],
    node: [u8; 4],
}

impl From<Route> for Slot {
    fn from(route: Route) -> Slot {
        Slot {
            generation: route.generation.to_le_bytes(),
            at: route.at.to_le_bytes(),
            node: route.node.to_le_bytes(),
        }
    }
}

impl From<Slot> for Route {
    fn from(slot: Slot) -> Route {
        Route {
            node: NodeId::from_le_bytes(slot.node),
            generation: u64::from_le_bytes(slot.generation),
            at: u64::from_le_bytes(slot.at),
        }
    }
}

// The layout the memory figures rest on (bench/RESULTS.md).
const _: () = assert!(std::mem::size_of::<(InlineKey, Slot)>() == 36);
const _: () = assert!(std::mem::align_of::<(InlineKey, Slot)>() == 1);

/// One shard: short process ids inline, longer ones boxed.
#[derive(Debug, Default)]
struct Shard {
    short: HashMap<InlineKey, Slot, RandomState>,
    long: HashMap<Box<str>, Slot, RandomState>,
}

impl Shard {
    fn get(&self, key: &str) -> Option<Route> {
        match InlineKey::new(key) {
            Some(inline) => self.short.get(&inline),
            None => self.long.get(key),
        }
        .map(|slot| Route::from(*slot))
    }

    fn insert(&mut self, key: &str, route: Route) -> Option<Route> {
        match InlineKey::new(key) {
            Some(inline) => self.short.insert(inline, route.into()),
            None => self.long.insert(key.into(), route.into()),
        }
        .map(Route::from)
    }

    fn remove(&mut self, key: &str) -> Option<Route> {
        match InlineKey::new(key) {
            Some(inline) => self.short.remove(&inline),
            None => self.long.remove(key),
        }
        .map(Route::from)
    }

    fn len(&self) -> usize {
        self.short.len() + self.long.len()
    }
}

/// What [`RouteMap::modify`] does to a process's route.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Change {
    /// Leaves it as it is.
    Keep,
    /// Stores this route (replacing the one there).
    Put(Route),
    /// Removes it.
    Remove,
}

/// The routes by process id, sharded.
#[derive(Debug)]
pub(super) struct RouteMap {
    shards: Box<[RwLock<Shard>]>,
    /// Picks the shard of a process id.
    hasher: RandomState,
    len: AtomicUsize,
}

impl Default for RouteMap {
    fn default() -> Self {
        RouteMap {
            shards: (0..SHARDS).map(|_| RwLock::default()).collect(),
            hasher: RandomState::default(),
            len: AtomicUsize::new(0),
        }
    }
}

impl RouteMap {
    fn shard(&self, key: &str) -> &RwLock<Shard> {
        &self.shards[self.shard_index(key)]
    }

    fn shard_index(&self, key: &str) -> usize {
        // The top bits: the shard's own map uses another hasher.
        let index = (self.hasher.hash_one(key) >> (64 - SHARDS.trailing_zeros())) as usize;
        index % SHARDS
    }

    /// The route of `key`.
    pub(super) fn get(&self, key: &str) -> Option<Route> {
        read(self.shard(key)).get(key)
    }

    /// Routes stored.
    pub(super) fn len(&self) -> usize {
        self.len.load(Ordering::Relaxed)
    }

    /// Decides, from the route of `key` (if any) and under its shard's
    /// lock, what becomes of it; returns the route there before and what
    /// `decide` returned.
    pub(super) fn modify<R>(
        &self,
        key: &str,
        decide: impl FnOnce(Option<Route>) -> (Change, R),
    ) -> (Option<Route>, R) {
        let mut shard = write(self.shard(key));
        let old = shard.get(key);
        let (change, result) = decide(old);
        match change {
            Change::Keep => {}
            Change::Put(route) => {
                if shard.insert(key, route).is_none() {
                    self.len.fetch_add(1, Ordering::Relaxed);
                }
            }
            Change::Remove => {
                if shard.remove(key).is_some() {
                    self.len.fetch_sub(1, Ordering::Relaxed);
                }
            }
        }
        (old, result)
    }

    /// [`RouteMap::modify`] for many keys at once: `decide(i, route)` for
    /// each item `i` of `0..count` (its key `key(i)`), the items of one
    /// key in their order. The items are taken shard by shard, each shard's
    /// under one hold of its lock, and the count of routes is updated once
    /// per shard: no locked instruction between two items' lookups, so the
    /// processor overlaps their cache misses (reading a large routes topic
    /// is mostly those).
    pub(super) fn modify_many<'k>(
        &self,
        count: usize,
        key: impl Fn(usize) -> &'k str,
        mut decide: impl FnMut(usize, Option<Route>) -> Change,
    ) {
        // Sorted by shard, then by item: a key's items keep their order.
        let mut order: Vec<(usize, usize)> =
            (0..count).map(|i| (self.shard_index(key(i)), i)).collect();
        order.sort_unstable();
        for run in order.chunk_by(|a, b| a.0 == b.0) {
            let mut shard = write(&self.shards[run[0].0]);
            let (mut added, mut removed) = (0usize, 0usize);
            for &(_, i) in run {
                let key = key(i);
                match decide(i, shard.get(key)) {
                    Change::Keep => {}
                    Change::Put(route) => {
                        if shard.insert(key, route).is_none() {
                            added += 1;
                        }
                    }
                    Change::Remove => {
                        if shard.remove(key).is_some() {
                            removed += 1;
                        }
                    }
                }
            }
            drop(shard);
            if added > removed {
                self.len.fetch_add(added - removed, Ordering::Relaxed);
            } else if removed > added {
                self.len.fetch_sub(removed - added, Ordering::Relaxed);
            }
        }
    }

    /// Removes the routes `evict` says to, one shard at a time; returns
    /// how many were removed per node.
    pub(super) fn evict(&self, mut evict: impl FnMut(&Route) -> bool) -> HashMap<NodeId, u64> {
        let mut removed: HashMap<NodeId, u64> = HashMap::new();
        for shard in &self.shards {
            let mut shard = write(shard);
            let before = shard.len();
            let mut keep = |slot: &Slot| {
                let route = Route::from(*slot);
                if evict(&route) {
                    *removed.entry(route.node).or_default() += 1;
                    false
                } else {
                    true
                }
            };
            shard.short.retain(|_, slot| keep(slot));
            shard.long.retain(|_, slot| keep(slot));
            self.len.fetch_sub(before - shard.len(), Ordering::Relaxed);
        }
        removed
    }

    /// Makes room for `routes` routes in all (capped), spread over the
    /// shards, so that reading a large topic does not grow (and copy) the
    /// maps again and again.
    pub(super) fn reserve(&self, routes: usize) {
        let routes = routes.min(MAX_RESERVE);
        // A shard's share, with room for an uneven spread.
        let share = routes / SHARDS + routes / SHARDS / 8 + 16;
        for shard in &self.shards {
            // Room for `share` in all, whatever is there already (the
            // reader may have applied records before).
            let mut shard = write(shard);
            let more = share.saturating_sub(shard.short.len());
            shard.short.reserve(more);
        }
    }

    /// Gives back room reserved and not used (a topic of many records
    /// replaced or removed since): a shard whose map is less than half
    /// full shrinks.
    pub(super) fn shrink(&self) {
        for shard in &self.shards {
            let shard = &mut *write(shard);
            let short = shard.short.len();
            if shard.short.capacity() > 2 * short + 64 {
                shard.short.shrink_to(short + short / 4);
            }
            let long = shard.long.len();
            if shard.long.capacity() > 2 * long + 64 {
                shard.long.shrink_to(long + long / 4);
            }
        }
    }

    #[cfg(test)]
    fn shard_lens(&self) -> Vec<usize> {
        self.shards.iter().map(|s| read(s).len()).collect()
    }
}

/// A node name, the routes that name it, and since when it has not been
/// live (`None` while live).
#[derive(Debug)]
struct NodeEntry {
    name: Arc<str>,
    routes: u64,
    down_since: Option<Instant>,
}

#[derive(Debug, Default)]
struct Nodes {
    ids: HashMap<Arc<str>, NodeId, RandomState>,
    entries: HashMap<NodeId, NodeEntry, RandomState>,
    next: NodeId,
    /// The live nodes, as last followed: read under the same lock as the
    /// entries, so that a name first seen while membership changes gets
    /// the liveness of the latest view, not of the one before.
    live: HashSet<String>,
}

/// The node names routes use, interned.
#[derive(Debug, Default)]
pub(super) struct NodeTable {
    nodes: Mutex<Nodes>,
    /// The names by id, for lookups: replaced when a name comes or goes.
    names: arc_swap::ArcSwap<HashMap<NodeId, Arc<str>>>,
}

impl NodeTable {
    /// The id of `name`, counting one more route for it (give it back with
    /// [`NodeTable::release`] if the route is not stored). A node not live
    /// (see [`NodeTable::follow_live`]) starts its eviction clock, and a
    /// route just written by one restarts it.
    pub(super) fn acquire(&self, name: &str, now: Instant) -> NodeId {
        let mut nodes = lock(&self.nodes);
        let live = nodes.live.contains(name);
        if let Some(&id) = nodes.ids.get(name)
            && let Some(entry) = nodes.entries.get_mut(&id)
        {
            entry.routes += 1;
            if entry.down_since.is_some() && !live {
                entry.down_since = Some(now);
            }
            return id;
        }
        let mut id = nodes.next;
        while nodes.entries.contains_key(&id) {
            id = id.wrapping_add(1);
        }
        nodes.next = id.wrapping_add(1);
        let name: Arc<str> = Arc::from(name);
        nodes.ids.insert(name.clone(), id);
        nodes.entries.insert(
            id,
            NodeEntry {
                name,
                routes: 1,
                down_since: (!live).then_some(now),
            },
        );
        self.publish(&nodes);
        id
    }

    /// One route fewer for each of `ids` (a name is forgotten by
    /// [`NodeTable::prune`]).
    pub(super) fn release(&self, ids: impl IntoIterator<Item = (NodeId, u64)>) {
        let mut nodes = lock(&self.nodes);
        for (id, routes) in ids {
            if let Some(entry) = nodes.entries.get_mut(&id) {
                entry.routes = entry.routes.saturating_sub(routes);
            }
        }
    }

    /// The name of `id`, without a lock.
    pub(super) fn name(&self, id: NodeId) -> Option<Arc<str>> {
        self.names.load().get(&id).cloned()
    }

    /// Names held.
    pub(super) fn len(&self) -> usize {
        lock(&self.nodes).entries.len()
    }

    /// Notes which nodes are `live` at `now`: the eviction clock of the
    /// others starts.
    pub(super) fn follow_live(&self, live: &HashSet<String>, now: Instant) {
        let mut nodes = lock(&self.nodes);
        nodes.live.clone_from(live);
        for entry in nodes.entries.values_mut() {
            if live.contains(&*entry.name) {
                entry.down_since = None;
            } else if entry.down_since.is_none() {
                entry.down_since = Some(now);
            }
        }
    }

    /// The nodes (but `self_id`) not live for `timeout` at `now`.
    pub(super) fn dead(
        &self,
        self_id: &str,
        now: Instant,
        timeout: Duration,
    ) -> HashMap<NodeId, Arc<str>> {
        lock(&self.nodes)
            .entries
            .iter()
            .filter(|(_, entry)| {
                *entry.name != *self_id
                    && entry
                        .down_since
                        .is_some_and(|since| now.saturating_duration_since(since) >= timeout)
            })
            .map(|(id, entry)| (*id, entry.name.clone()))
            .collect()
    }

    /// Forgets the names no route uses.
    pub(super) fn prune(&self) {
        let mut nodes = lock(&self.nodes);
        let unused: Vec<NodeId> = nodes
            .entries
            .iter()
            .filter(|(_, entry)| entry.routes == 0)
            .map(|(id, _)| *id)
            .collect();
        if unused.is_empty() {
            return;
        }
        for id in unused {
            if let Some(entry) = nodes.entries.remove(&id) {
                nodes.ids.remove(&entry.name);
            }
        }
        self.publish(&nodes);
    }

    fn publish(&self, nodes: &Nodes) {
        self.names.store(Arc::new(
            nodes
                .entries
                .iter()
                .map(|(id, entry)| (*id, entry.name.clone()))
                .collect(),
        ));
    }

    #[cfg(test)]
    fn routes_of(&self, name: &str) -> Option<u64> {
        let nodes = lock(&self.nodes);
        let id = nodes.ids.get(name)?;
        nodes.entries.get(id).map(|entry| entry.routes)
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}

fn read<T>(lock: &RwLock<T>) -> std::sync::RwLockReadGuard<'_, T> {
    lock.read().unwrap_or_else(|e| e.into_inner())
}

fn write<T>(lock: &RwLock<T>) -> std::sync::RwLockWriteGuard<'_, T> {
    lock.write().unwrap_or_else(|e| e.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn route(node: NodeId, generation: u64, offset: i64) -> Route {
        Route {
            node,
            generation,
            at: place(Some((0, offset))),
        }
    }

    #[test]
    fn many_keys_change_shard_by_shard_each_key_in_its_order() {
        let map = RouteMap::default();
        let route = |node, generation| Route {
            node,
            generation,
            at: 1,
        };
        map.modify("gone", |_| (Change::Put(route(1, 1)), ()));
        // Two items of one key: the second sees the first's route.
        let mut keys: Vec<String> = (0..500).map(|n| format!("process-{n}")).collect();
        keys.push("process-7".to_string());
        keys.push("gone".to_string());
        keys.push("a-process-id-longer-than-fifteen-bytes".to_string());
        let mut seen = vec![None; keys.len()];
        map.modify_many(
            keys.len(),
            |i| keys[i].as_str(),
            |i, old| {
                seen[i] = old;
                match keys[i].as_str() {
                    "gone" => Change::Remove,
                    "process-9" => Change::Keep,
                    _ => Change::Put(route(2, i as u64)),
                }
            },
        );
        assert_eq!(seen[7], None);
        assert_eq!(
            seen[500],
            Some(route(2, 7)),
            "the key's first item came first"
        );
        assert_eq!(map.get("process-7"), Some(route(2, 500)));
        assert_eq!(seen[501], Some(route(1, 1)));
        assert_eq!(map.get("gone"), None);
        assert_eq!(map.get("process-9"), None);
        assert_eq!(
            map.get("a-process-id-longer-than-fifteen-bytes"),
            Some(route(2, 502))
        );
        // 500 keys, one kept out, one long one; "gone" is gone.
        assert_eq!(map.len(), 500);
        assert_eq!(
            map.len(),
            map.shards.iter().map(|s| read(s).len()).sum::<usize>()
        );
    }

    #[test]
    fn places_order_as_partition_then_offset_and_a_learned_route_comes_first() {
        let mut places = vec![
            place(Some((1, 0))),
            place(Some((0, 5))),
            place(None),
            place(Some((0, 0))),
            place(Some((0, (1 << 48) - 1))),
            place(Some((0xFFFE, 7))),
        ];
        let sorted = places.clone();
        places.sort_unstable();
        assert_eq!(
            places,
            vec![
                sorted[2], sorted[3], sorted[1], sorted[4], sorted[0], sorted[5]
            ]
        );
        assert_eq!(place(None), 0);
        assert!(place(Some((0, 0))) > 0);
        assert!(
            route(1, 5, 0).order()
                > Route {
                    node: 1,
                    generation: 5,
                    at: 0
                }
                .order()
        );
        assert!(
            Route {
                node: 1,
                generation: 6,
                at: 0
            }
            .learned()
        );
        // Saturates rather than wrapping.
        assert_eq!(place(Some((0, i64::MAX))), place(Some((0, (1 << 48) - 1))));
        assert_eq!(place(Some((0, -1))), place(Some((0, 0))));
    }

    #[test]
    fn short_and_long_process_ids_are_kept_apart_and_both_found() {
        let map = RouteMap::default();
        let short = "proc-0000001";
        let edge = "a".repeat(INLINE_KEY);
        let long = "a".repeat(INLINE_KEY + 1);
        for (i, key) in [short, edge.as_str(), long.as_str(), ""].iter().enumerate() {
            map.modify(key, |old| {
                assert_eq!(old, None);
                (Change::Put(route(i as NodeId, 1, i as i64)), ())
            });
        }
        assert_eq!(map.len(), 4);
        assert_eq!(map.get(short), Some(route(0, 1, 0)));
        assert_eq!(map.get(&edge), Some(route(1, 1, 1)));
        assert_eq!(map.get(&long), Some(route(2, 1, 2)));
        assert_eq!(map.get(""), Some(route(3, 1, 3)));
        // A prefix or a NUL-padded id is another process.
        assert_eq!(map.get("proc-000000"), None);
        assert_eq!(map.get("proc-0000001\0"), None);
        let inline: usize = map.shards.iter().map(|s| read(s).short.len()).sum();
        let boxed: usize = map.shards.iter().map(|s| read(s).long.len()).sum();
        assert_eq!((inline, boxed), (3, 1));
        // Replacing is no new route; removing is one fewer.
        let (old, ()) = map.modify(&long, |_| (Change::Put(route(5, 2, 9)), ()));
        assert_eq!(old, Some(route(2, 1, 2)));
        assert_eq!(map.len(), 4);
        map.modify(short, |_| (Change::Remove, ()));
        map.modify("nobody", |_| (Change::Remove, ()));
        assert_eq!(map.len(), 3);
        assert_eq!(map.get(short), None);
    }

    #[test]
    fn routes_spread_over_the_shards_and_eviction_visits_them_all() {
        let map = RouteMap::default();
        map.reserve(10_000);
        for i in 0..10_000 {
            let key = format!("proc-{i:07}");
            map.modify(&key, |_| {
                (
                    Change::Put(route(NodeId::from(i % 2 == 0), 1, i64::from(i))),
                    (),
                )
            });
        }
        let lens = map.shard_lens();
        assert_eq!(lens.iter().sum::<usize>(), 10_000);
        let fair = 10_000 / SHARDS;
        assert!(
            lens.iter().all(|&n| n > fair / 2 && n < fair * 2),
            "uneven shards: {lens:?}"
        );
        let removed = map.evict(|r| r.node == 1);
        assert_eq!(removed, HashMap::from([(1, 5_000)]));
        assert_eq!(map.len(), 5_000);
        assert_eq!(map.get("proc-0000000"), None);
        assert_eq!(map.get("proc-0000001"), Some(route(0, 1, 1)));
        // Emptied, the room is given back.
        map.evict(|_| true);
        map.shrink();
        assert!(map.shards.iter().all(|s| read(s).short.capacity() == 0));
        assert_eq!(map.len(), 0);
    }

    #[test]
    fn the_table_of_a_million_routes_takes_under_80_bytes_a_route() {
        // The maps' own memory: 36-byte entries and a control byte, in a
        // table at least 7/16 full (a power of two of buckets).
        let map = RouteMap::default();
        map.reserve(1_000_000);
        let buckets: usize = map
            .shards
            .iter()
            .map(|s| (read(s).short.capacity() * 8 / 7).next_power_of_two())
            .sum();
        let bytes = buckets * (36 + 1);
        assert!(bytes / 1_000_000 < 80, "{bytes} bytes");
    }

    #[test]
    fn node_names_are_interned_counted_and_pruned_without_reusing_ids() {
        let nodes = NodeTable::default();
        let now = Instant::now();
        nodes.follow_live(&HashSet::from(["b".to_string(), "c".to_string()]), now);
        let b = nodes.acquire("b", now);
        assert_eq!(nodes.acquire("b", now), b, "interned");
        let c = nodes.acquire("c", now);
        assert_ne!(b, c);
        assert_eq!(nodes.len(), 2);
        assert_eq!(nodes.routes_of("b"), Some(2));
        assert_eq!(nodes.name(b).as_deref(), Some("b"));
        nodes.release([(b, 1)]);
        nodes.prune();
        assert_eq!(nodes.name(b).as_deref(), Some("b"), "one route left");
        nodes.release([(b, 1)]);
        nodes.prune();
        assert_eq!(nodes.name(b), None);
        assert_eq!(nodes.len(), 1);
        // Seen again: a new id, so a stale id never names another node.
        let again = nodes.acquire("b", now);
        assert_ne!(again, b);
        assert_eq!(nodes.name(again).as_deref(), Some("b"));
    }

    #[test]
    fn a_node_not_live_for_the_timeout_is_dead_but_never_this_one() {
        let nodes = NodeTable::default();
        let t0 = Instant::now();
        let timeout = Duration::from_secs(5);
        let a = nodes.acquire("a", t0);
        nodes.follow_live(&HashSet::from(["b".to_string()]), t0);
        let b = nodes.acquire("b", t0);
        let x = nodes.acquire("x", t0);
        nodes.follow_live(&HashSet::from(["a".to_string()]), t0);
        assert!(nodes.dead("a", t0 + timeout / 2, timeout).is_empty());
        let dead = nodes.dead("a", t0 + timeout, timeout);
        assert_eq!(
            dead.keys().copied().collect::<HashSet<_>>(),
            HashSet::from([b, x])
        );
        assert!(!dead.contains_key(&a));
        // A route written by x restarts its clock.
        nodes.acquire("x", t0 + timeout);
        assert!(!nodes.dead("a", t0 + timeout, timeout).contains_key(&x));
    }
}
