//! Latency percentiles and throughput over what a receiver saw.

use serde_json::{Value, json};

/// What a receiver saw: per message, its sequence number, when it was
/// sent and when it arrived (ns since the epoch).
#[derive(Debug, Default)]
pub(crate) struct Observations {
    pub(crate) arrivals: Vec<(u64, u64, u64)>,
    pub(crate) duplicates: u64,
}

impl Observations {
    /// Summary: counts, throughput (from the arrival of the message at
    /// `steady_from` of the run, a fraction, to the last one), and latency
    /// percentiles over messages with seq >= `warmup`.
    pub(crate) fn summary(&mut self, steady_from: f64, warmup: u64) -> Value {
        self.arrivals.sort_by_key(|a| a.2);
        let n = self.arrivals.len();
        if n == 0 {
            return json!({"received": 0});
        }
        let first = self.arrivals[0].2;
        let last = self.arrivals[n - 1].2;
        let first_sent = self.arrivals.iter().map(|a| a.1).min().unwrap_or(first);
        let k = ((n as f64) * steady_from) as usize;
        let k = k.min(n - 1);
        let steady_secs = (last - self.arrivals[k].2) as f64 / 1e9;
        let steady_rate = if steady_secs > 0.0 {
            (n - 1 - k) as f64 / steady_secs
        } else {
            0.0
        };
        let total_secs = (last - first) as f64 / 1e9;
        let mut latencies: Vec<f64> = self
            .arrivals
            .iter()
            .filter(|a| a.0 >= warmup)
            .map(|a| a.2.saturating_sub(a.1) as f64 / 1e6)
            .collect();
        latencies.sort_by(f64::total_cmp);
        json!({
            "received": n,
            "duplicates": self.duplicates,
            "first_arrival_after_first_send_s": (first.saturating_sub(first_sent)) as f64 / 1e9,
            "arrival_span_s": total_secs,
            "rate_per_s": if total_secs > 0.0 { (n - 1) as f64 / total_secs } else { 0.0 },
            "steady_rate_per_s": steady_rate,
            "latency_samples": latencies.len(),
            "latency_ms_mean": if latencies.is_empty() { 0.0 } else { latencies.iter().sum::<f64>() / latencies.len() as f64 },
            "latency_ms_p50": percentile(&latencies, 0.50),
            "latency_ms_p90": percentile(&latencies, 0.90),
            "latency_ms_p99": percentile(&latencies, 0.99),
            "latency_ms_max": latencies.last().copied().unwrap_or(0.0),
        })
    }
}

/// The `p` quantile of sorted values (nearest rank).
pub(crate) fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = ((sorted.len() as f64) * p).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}
