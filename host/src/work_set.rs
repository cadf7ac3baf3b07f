//! A queue of keys to look at, each at most once however often it is added:
//! work that is level-triggered ("this process's route may be out of date")
//! rather than a log of every change, so it stays as small as the set of
//! distinct keys while its consumer is held up (a broker out of reach), and
//! a burst of changes to one key costs one look. Each key carries the
//! latest value added with it (the state to reach); it keeps the place it
//! was first added at. First added, first taken.

use std::collections::{HashMap, VecDeque};
use std::sync::{Mutex, MutexGuard};

use tokio::sync::Notify;

/// Keys waiting to be looked at, each once with its latest value, oldest
/// first.
#[derive(Debug)]
pub struct WorkSet<V = ()> {
    pending: Mutex<(VecDeque<String>, HashMap<String, V>)>,
    ready: Notify,
}

impl<V> Default for WorkSet<V> {
    fn default() -> Self {
        WorkSet {
            pending: Mutex::new((VecDeque::new(), HashMap::new())),
            ready: Notify::new(),
        }
    }
}

impl WorkSet<()> {
    /// Adds `keys` (those not waiting already) and wakes the consumer.
    pub fn add_keys<'a>(&self, keys: impl IntoIterator<Item = &'a str>) {
        let mut pending = self.lock();
        for key in keys {
            Self::put(&mut pending, key, ());
        }
        drop(pending);
        self.ready.notify_one();
    }
}

impl<V> WorkSet<V> {
    /// Adds `key` with `value`: in its old place with the new value when it
    /// is waiting already, else last. Wakes the consumer.
    pub fn add(&self, key: &str, value: V) {
        Self::put(&mut self.lock(), key, value);
        self.ready.notify_one();
    }

    fn put(pending: &mut (VecDeque<String>, HashMap<String, V>), key: &str, value: V) {
        let (queue, values) = pending;
        if let Some(waiting) = values.get_mut(key) {
            *waiting = value;
        } else {
            values.insert(key.to_string(), value);
            queue.push_back(key.to_string());
        }
    }

    /// Up to `max` keys with their values, oldest first, and whether more
    /// are waiting.
    pub fn take(&self, max: usize) -> (Vec<(String, V)>, bool) {
        let mut pending = self.lock();
        let (queue, values) = &mut *pending;
        let taken = queue
            .drain(..max.min(queue.len()))
            .filter_map(|key| values.remove(&key).map(|value| (key, value)))
            .collect();
        (taken, !queue.is_empty())
    }

    /// Keys waiting.
    pub fn len(&self) -> usize {
        self.lock().0.len()
    }

    /// Whether no key is waiting.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Resolves once keys were added since the last wake-up (a wake-up
    /// that found nobody waiting is kept for the next call).
    pub async fn added(&self) {
        self.ready.notified().await;
    }

    /// Wakes the consumer again (it took a turn and more are waiting).
    pub fn wake(&self) {
        self.ready.notify_one();
    }

    fn lock(&self) -> MutexGuard<'_, (VecDeque<String>, HashMap<String, V>)> {
        self.pending.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys<V>(taken: Vec<(String, V)>) -> Vec<String> {
        taken.into_iter().map(|(key, _)| key).collect()
    }

    #[test]
    fn a_key_added_many_times_waits_once_in_the_order_first_added() {
        let set = WorkSet::default();
        for round in 0..10_000 {
            set.add_keys(["p-1", "p-2"]);
            if round == 0 {
                set.add_keys(["p-0"]);
            }
        }
        assert_eq!(set.len(), 3);
        let (taken, more) = set.take(2);
        assert_eq!(
            (keys(taken), more),
            (vec!["p-1".to_string(), "p-2".to_string()], true)
        );
        set.add_keys(["p-1"]);
        let (taken, more) = set.take(10);
        assert_eq!(
            (keys(taken), more),
            (vec!["p-0".to_string(), "p-1".to_string()], false)
        );
        assert!(set.is_empty());
    }

    #[test]
    fn a_key_keeps_its_place_and_takes_the_latest_value() {
        let set = WorkSet::default();
        set.add("p-1", Some(1));
        set.add("p-2", Some(2));
        set.add("p-1", None);
        set.add("p-1", Some(3));
        assert_eq!(
            set.take(10),
            (
                vec![("p-1".to_string(), Some(3)), ("p-2".to_string(), Some(2))],
                false
            )
        );
    }

    #[tokio::test]
    async fn an_add_before_the_consumer_waits_is_not_missed() {
        let set = WorkSet::default();
        set.add_keys(["p"]);
        tokio::time::timeout(std::time::Duration::from_secs(1), set.added())
            .await
            .expect("the add woke nobody");
    }
}
