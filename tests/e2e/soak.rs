//! The soak (`scripts/soak.sh MINUTES` runs it; ignored otherwise, it
//! takes minutes): a sidecar and a three-node cluster under steady load
//! for `WASMRELAY_SOAK_MINUTES`, with a fault every minute in turn (the
//! application away, the network to the broker cut, a node SIGKILLed and
//! restarted, a client reconnect storm, the broker frozen for 4 s). Every
//! 10 s it records each relay's RSS (and of it, anonymous memory and file
//! pages), heap in use (`wasmrelay_heap_in_use_bytes`), open files,
//! threads, tokio tasks, client connections and unfinished records into
//! `WASMRELAY_SOAK_CSV`; at the end nothing may be lost, and the heap in
//! use and the open files (less the client connections a node holds, which
//! move between nodes by design) of the processes that ran throughout must
//! be flat after the warm-up: the least-squares line through the samples
//! of whole fault cycles from minute 5 may grow under 5% to the end. The
//! anonymous memory and the RSS are reported beside, not judged: the RSS
//! is mostly the debug binary's pages, and the anonymous memory also holds
//! what glibc keeps free after a burst. The relays run with glibc's
//! per-thread cache off ([`NO_THREAD_CACHE`]), so that the heap in use is
//! what is allocated and not freed.

use std::collections::HashSet;
use std::io::Write as _;
use std::time::{Duration, Instant};

use serde_json::json;
use support::app::{Receipt, TestApp};
use support::chaos::{ChaosRun, Load, Outcome};
use support::fault_proxy::FaultProxy;
use support::processes::{ProcessPool, node_config};
use support::relay::RelayProcess;
use support::tansu::{Tansu, TestRecord};

use crate::sidecar_flow::{INPUT, config};

/// Every relay of the soak runs without glibc's per-thread cache of freed
/// chunks (tcache): `mallinfo2`, which `wasmrelay_heap_in_use_bytes` reads,
/// counts the chunks held there as in use. Each thread keeps up to 7 freed
/// chunks of each size up to 1 KiB (up to about 230 KiB a thread), and
/// fills them as it frees chunks of sizes it had not freed before, so with
/// the cache on, the heap "in use" of every relay creeps up for half an
/// hour with nothing leaked (docs/RELIABILITY.md, 2026-12-06).
const NO_THREAD_CACHE: (&str, &str) = ("GLIBC_TUNABLES", "glibc.malloc.tcache_count=0");
use wasmrelay_test_support as support;

const BUSINESS: &str = "business";
const SAMPLE_EVERY: Duration = Duration::from_secs(10);
const FAULT_EVERY: Duration = Duration::from_secs(60);
const RATE: usize = 100;

fn minutes() -> u64 {
    let text = std::env::var("WASMRELAY_SOAK_MINUTES")
        .expect("WASMRELAY_SOAK_MINUTES: how long the soak runs (scripts/soak.sh sets it)");
    text.trim()
        .parse()
        .unwrap_or_else(|_| panic!("WASMRELAY_SOAK_MINUTES is not a number of minutes: {text:?}"))
}

/// One sample of one process.
#[derive(Debug, Clone)]
struct Sample {
    seconds: u64,
    process: String,
    rss_kib: u64,
    /// Of the RSS, anonymous memory (heap, stacks, anonymous maps): what
    /// the process holds, and what a leak raises.
    anon_kib: u64,
    /// Of the RSS, pages of mapped files (the binary's code, mostly: a
    /// debug build is 500 MiB), paged in as code runs for the first time
    /// and given back by the kernel when it likes.
    file_kib: u64,
    /// glibc's heap allocated and not freed (`wasmrelay_heap_in_use_bytes`,
    /// KiB): what the relay holds, without the free memory the allocator
    /// keeps; a leak raises it.
    heap_in_use_kib: u64,
    open_files: u64,
    threads: u64,
    tasks: u64,
    /// Business processes connected (cluster nodes; 0 for the sidecar).
    connections: u64,
    /// Records of the process's flow consumed and not finished yet.
    in_progress: u64,
    /// Of those, the ones waiting for acknowledgements.
    awaiting_ack: u64,
}

impl Sample {
    /// Open files not explained by the client connections the node holds:
    /// what a leak of files would raise. A node's clients move between
    /// nodes by design (placement, a reconnect storm, a peer's restart), so
    /// its raw count follows them.
    fn files_less_clients(&self) -> u64 {
        self.open_files.saturating_sub(self.connections)
    }
}

fn status_field(status: &str, field: &str) -> u64 {
    status
        .lines()
        .find_map(|line| line.strip_prefix(field))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

/// Samples `relay`, whose flow is `flow`.
fn sample(seconds: u64, name: &str, flow: &str, relay: &RelayProcess) -> Sample {
    let pid = relay.pid();
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let open_files = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|entries| entries.count() as u64)
        .unwrap_or(0);
    Sample {
        seconds,
        process: name.to_string(),
        rss_kib: status_field(&status, "VmRSS:"),
        anon_kib: status_field(&status, "RssAnon:"),
        file_kib: status_field(&status, "RssFile:"),
        heap_in_use_kib: relay.metric("wasmrelay_heap_in_use_bytes") / 1024,
        open_files,
        threads: status_field(&status, "Threads:"),
        tasks: relay.metric("wasmrelay_runtime_tasks"),
        connections: relay.metric("wasmrelay_cluster_connections"),
        in_progress: relay.metric(&format!(
            "wasmrelay_messages_in_progress{{flow=\"{flow}\"}}"
        )),
        awaiting_ack: relay.metric(&format!(
            "wasmrelay_messages_awaiting_ack{{flow=\"{flow}\"}}"
        )),
    }
}

fn median(mut values: Vec<u64>) -> u64 {
    values.sort_unstable();
    values.get(values.len() / 2).copied().unwrap_or(0)
}

/// The least-squares line through `field` over the samples of `process`
/// in `[from, to)` s, as its values at `from` and at `to`: the trend, which
/// a leak raises and the ups and downs of a fault cycle (a backlog after a
/// broker cut, a Kafka client's extra bootstrap connection until the next
/// restart) do not, when the span is whole cycles.
fn trend(
    samples: &[Sample],
    process: &str,
    from: u64,
    to: u64,
    field: fn(&Sample) -> u64,
) -> (f64, f64) {
    let points: Vec<(f64, f64)> = samples
        .iter()
        .filter(|s| s.process == process && s.seconds >= from && s.seconds < to)
        .map(|s| (s.seconds as f64, field(s) as f64))
        .collect();
    let n = points.len() as f64;
    if points.len() < 2 {
        let level = points.first().map_or(0.0, |p| p.1);
        return (level, level);
    }
    let mean_x = points.iter().map(|p| p.0).sum::<f64>() / n;
    let mean_y = points.iter().map(|p| p.1).sum::<f64>() / n;
    let covariance: f64 = points.iter().map(|p| (p.0 - mean_x) * (p.1 - mean_y)).sum();
    let variance: f64 = points.iter().map(|p| (p.0 - mean_x).powi(2)).sum();
    let slope = if variance > 0.0 {
        covariance / variance
    } else {
        0.0
    };
    let at = |x: f64| mean_y + slope * (x - mean_x);
    (at(from as f64), at(to as f64))
}

/// The median of `field` over the samples of `process` in `[from, to)` s.
fn window(samples: &[Sample], process: &str, from: u64, to: u64, field: fn(&Sample) -> u64) -> u64 {
    median(
        samples
            .iter()
            .filter(|s| s.process == process && s.seconds >= from && s.seconds < to)
            .map(field)
            .collect(),
    )
}

/// Where the judged span ends: minute 5 plus as many whole fault cycles
/// as fit in a run of `end` seconds.
fn judged_span_end(end: u64, cycle: u64) -> u64 {
    cycle + (end - cycle) / cycle * cycle
}

fn answer(receipt: &Receipt) -> (u16, Vec<u8>, Vec<(String, String)>) {
    let body = json!({"answer_to": receipt.delivery_id});
    (200, body.to_string().into_bytes(), Vec::new())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "runs for minutes: scripts/soak.sh MINUTES runs it"]
async fn soak_a_sidecar_and_a_cluster_under_load_and_faults_stay_flat() {
    let total = Duration::from_secs(minutes() * 60);
    let csv_path = std::env::var("WASMRELAY_SOAK_CSV")
        .unwrap_or_else(|_| "target/soak/samples.csv".to_string());
    if let Some(dir) = std::path::Path::new(&csv_path).parent() {
        std::fs::create_dir_all(dir).unwrap();
    }
    let mut csv = std::fs::File::create(&csv_path).unwrap();
    writeln!(
        csv,
        "seconds,process,rss_kib,anon_kib,file_kib,open_files,threads,tasks,connections,in_progress,awaiting_ack,heap_in_use_kib"
    )
    .unwrap();

    let kafka = Tansu::start_behind_proxy();
    kafka.create_topic(INPUT, 3).await;
    kafka.create_topic("service-calls.dlq", 1).await;
    kafka.create_topic(BUSINESS, 6).await;
    kafka.create_topic("business.dlq", 1).await;

    // The sidecar, its application behind a proxy.
    let app = TestApp::start(answer).await;
    let app_proxy = FaultProxy::to(
        app.url
            .trim_start_matches("http://")
            .trim_end_matches("/calls")
            .parse()
            .unwrap(),
    );
    // The sidecar's producer batches as it would in production: the tests'
    // one record per batch (kept for the cluster, which reads back what it
    // writes, see support::tansu) caps an idempotent producer at five
    // records a round trip, for all partitions together; on this loaded
    // machine that is about the load's rate, so after the first broker cut
    // the backlog never drained (docs/RELIABILITY.md, "Soak").
    let sidecar_config = config(
        &kafka,
        &format!("http://{}/calls", app_proxy.addr()),
        r#""json-enrich""#,
        "",
    )
    .replace("\"batch.num.messages\" = \"1\"\n", "");
    assert!(!sidecar_config.contains("batch.num.messages"));
    // WASMRELAY_SOAK_HEAPTRACK=path: the sidecar runs with heaptrack's
    // preload library and writes its raw trace to `path` (read it with
    // `heaptrack_interpret < path | zstd > trace.zst` and
    // `heaptrack_print --print-leaks trace.zst`): what its heap holds at
    // the end, by call stack.
    const HEAPTRACK_PRELOAD: &str = "/usr/lib/heaptrack/libheaptrack_preload.so";
    let heaptrack = std::env::var("WASMRELAY_SOAK_HEAPTRACK").ok();
    if heaptrack.is_some() {
        // Without it the loader only warns and the relay runs untraced.
        assert!(
            std::path::Path::new(HEAPTRACK_PRELOAD).exists(),
            "WASMRELAY_SOAK_HEAPTRACK is set but {HEAPTRACK_PRELOAD} is missing: apt-get install -y heaptrack"
        );
    }
    let mut sidecar_env: Vec<(&str, &str)> = vec![NO_THREAD_CACHE];
    if let Some(path) = &heaptrack {
        sidecar_env.push(("LD_PRELOAD", HEAPTRACK_PRELOAD));
        sidecar_env.push(("DUMP_HEAPTRACK_OUTPUT", path.as_str()));
    }
    let sidecar = RelayProcess::start(&sidecar_config, &sidecar_env);

    // The cluster: processes reach node-a and node-b through proxies (the
    // storm resets them); node-c is the one killed and restarted.
    let start_node = |id: &str| {
        RelayProcess::start(&node_config(id, &kafka.bootstrap(), ""), &[NO_THREAD_CACHE])
    };
    let node_a = start_node("node-a");
    let node_b = start_node("node-b");
    let mut node_c = Some(start_node("node-c"));
    let client_proxies = [
        FaultProxy::to(node_a.client_addr().unwrap().parse().unwrap()),
        FaultProxy::to(node_b.client_addr().unwrap().parse().unwrap()),
    ];
    let processes: Vec<String> = (0..100).map(|n| format!("p-{n:03}")).collect();
    let mut pool = ProcessPool::default();
    for (i, id) in processes.iter().enumerate() {
        let mut addresses: Vec<String> = client_proxies
            .iter()
            .map(|p| p.addr().to_string())
            .collect();
        addresses.rotate_left(i % 2);
        pool.connect(&addresses, id, false).await;
    }

    let mut sidecar_run = ChaosRun::start("soak: sidecar");
    let mut cluster_run = ChaosRun::start("soak: cluster");
    let sidecar_load = Load::start(kafka.producer_config(), INPUT, RATE, |n| {
        TestRecord::keyed(format!("key-{}", n % 31), json!({"n": n}).to_string())
    });
    let cluster_load = {
        let processes = processes.clone();
        Load::start(kafka.producer_config(), BUSINESS, RATE, move |n| {
            let process = &processes[n % processes.len()];
            TestRecord::keyed(process.clone(), n.to_string()).header("process-id", process.clone())
        })
    };
    let cluster_delivered = |pool: &ProcessPool| {
        pool.received()
            .into_iter()
            .map(|r| r.value)
            .collect::<HashSet<_>>()
            .len()
    };

    let started = Instant::now();
    let mut samples: Vec<Sample> = Vec::new();
    let mut next_sample = Duration::ZERO;
    let mut faults = 0u32;
    // What to undo, and when.
    let mut undo: Option<(Instant, &'static str)> = None;
    loop {
        let elapsed = started.elapsed();
        let ending = elapsed >= total;
        if !ending && elapsed >= next_sample {
            let seconds = elapsed.as_secs();
            let mut now = vec![
                sample(seconds, "sidecar", "orders", &sidecar),
                sample(seconds, "node-a", BUSINESS, &node_a),
                sample(seconds, "node-b", BUSINESS, &node_b),
            ];
            if let Some(node) = &node_c {
                now.push(sample(seconds, "node-c (restarted)", BUSINESS, node));
            }
            for s in &now {
                writeln!(
                    csv,
                    "{},{},{},{},{},{},{},{},{},{},{},{}",
                    s.seconds,
                    s.process,
                    s.rss_kib,
                    s.anon_kib,
                    s.file_kib,
                    s.open_files,
                    s.threads,
                    s.tasks,
                    s.connections,
                    s.in_progress,
                    s.awaiting_ack,
                    s.heap_in_use_kib
                )
                .unwrap();
            }
            csv.flush().unwrap();
            samples.extend(now);
            next_sample += SAMPLE_EVERY;
            sidecar_run.observe(sidecar_load.acknowledged(), app.distinct_deliveries());
            cluster_run.observe(cluster_load.acknowledged(), cluster_delivered(&pool));
        }
        if !ending && undo.is_none() && elapsed >= FAULT_EVERY * faults + FAULT_EVERY / 2 {
            let fault = match faults % 5 {
                0 => {
                    app_proxy.cut();
                    "app"
                }
                1 => {
                    kafka.proxy().cut();
                    "network"
                }
                2 => {
                    if let Some(mut node) = node_c.take() {
                        node.sigkill();
                    }
                    "node-c"
                }
                3 => {
                    for proxy in &client_proxies {
                        proxy.reset();
                    }
                    "storm"
                }
                _ => {
                    kafka.freeze();
                    "freeze"
                }
            };
            eprintln!("soak: {:?} in: fault {fault}", elapsed);
            // A freeze shorter than the consumers' session (6 s): one that
            // outlives it leaves tansu's group without a live leader
            // (docs/RELIABILITY.md, scenario b).
            let lasts = if fault == "freeze" { 4 } else { 8 };
            undo = Some((Instant::now() + Duration::from_secs(lasts), fault));
            faults += 1;
        }
        // Undoes the fault in progress: when its time is up, and at the end.
        if let Some((at, fault)) = undo
            && (Instant::now() >= at || ending)
        {
            match fault {
                "app" => app_proxy.restore(),
                "network" => kafka.proxy().restore(),
                "node-c" => node_c = Some(start_node("node-c")),
                "freeze" => kafka.thaw(),
                _ => {}
            }
            undo = None;
        }
        if ending {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // Nothing lost.
    let produced = sidecar_load.stop().await;
    sidecar_run
        .drain(
            produced,
            Duration::from_secs(180),
            || app.distinct_deliveries(),
            || sidecar.log(),
        )
        .await;
    sidecar_run.finish(Outcome {
        delivered: app.distinct_deliveries(),
        duplicated: app.count() - app.distinct_deliveries(),
        dead_lettered: 0,
    });
    let produced = cluster_load.stop().await;
    cluster_run
        .drain(
            produced,
            Duration::from_secs(180),
            || cluster_delivered(&pool),
            || node_a.log(),
        )
        .await;
    let received = pool.received().len();
    let delivered = cluster_delivered(&pool);
    cluster_run.finish(Outcome {
        delivered,
        duplicated: received - delivered,
        dead_lettered: 0,
    });

    // Flat after the warm-up: the growth of the trend (a least-squares
    // line) from minute 5 to the end, over whole fault cycles (5 minutes,
    // the five faults once each). What a relay holds depends on where in
    // the cycle it is (a backlog and its buffers after a broker cut, a Kafka
    // client's bootstrap connection held until the next restart), about
    // 1 MiB of anonymous memory on a 16 MiB base: the 2026-12-04 run's
    // first and last cycles' medians differed by 7% within one 15.5-17.6
    // MiB band. So the rule judges the line through every sample of whole
    // cycles, which such ups and downs do not tilt and a leak or a step
    // that stays does (tests below). The
    // medians of the first and last cycles are reported beside. A run
    // shorter than 15 minutes judges its second half's line.
    let end = total.as_secs();
    let cycle = FAULT_EVERY.as_secs() * 5;
    let (warm, judged_to, early_to, late_from) = if end >= 3 * cycle {
        // Whole cycles from minute 5: the last one may be cut short by the
        // run's length, so the line ends at the last whole cycle's end.
        let judged_to = judged_span_end(end, cycle);
        (cycle, judged_to, 2 * cycle, judged_to - cycle)
    } else {
        (end / 2, end + 1, end / 2 + end / 4, end / 2 + end / 4)
    };
    let mut report = Vec::new();
    for process in ["sidecar", "node-a", "node-b"] {
        // Judged: the heap in use and open files. The anonymous memory
        // and the RSS are shown beside: the RSS is mostly the binary's
        // pages, which grow as code paths run for the first time (a fault's
        // error paths), and the anonymous memory also counts what glibc
        // keeps free after a burst, in pages partly in use
        // (docs/RELIABILITY.md, "2026-12-05").
        for (what, judged, field) in [
            (
                "heap_in_use_kib",
                true,
                (|s: &Sample| s.heap_in_use_kib) as fn(&Sample) -> u64,
            ),
            ("anon_kib", false, |s: &Sample| s.anon_kib),
            ("rss_kib", false, |s: &Sample| s.rss_kib),
            ("open_files_less_clients", true, Sample::files_less_clients),
        ] {
            let (from_level, to_level) = trend(&samples, process, warm, judged_to, field);
            let growth = (to_level - from_level) / from_level.max(1.0);
            report.push(json!({
                "process": process, "what": what,
                "after_warm_up": from_level.round() as u64,
                "at_the_end": to_level.round() as u64,
                "growth": growth, "judged": judged,
                "first_cycle_median": window(&samples, process, warm, early_to, field),
                "last_cycle_median": window(&samples, process, late_from, judged_to, field),
            }));
        }
    }
    // scripts/soak.sh prints these.
    #[allow(clippy::print_stdout)]
    for line in &report {
        println!("soak-growth {line}");
    }
    // The restarted node-c ran until here, for the drain.
    drop(node_c);
    for line in report.iter().filter(|line| line["judged"] == true) {
        assert!(
            line["growth"].as_f64().unwrap() < 0.05,
            "not flat after the warm-up: {line}"
        );
    }
}

#[cfg(test)]
mod flatness_rule {
    use super::*;

    fn samples(values: impl Fn(u64) -> u64) -> Vec<Sample> {
        (0..180)
            .map(|i| Sample {
                seconds: i * 10,
                process: "p".into(),
                rss_kib: 0,
                anon_kib: values(i * 10),
                file_kib: 0,
                heap_in_use_kib: 0,
                open_files: 0,
                threads: 0,
                tasks: 0,
                connections: 0,
                in_progress: 0,
                awaiting_ack: 0,
            })
            .collect()
    }

    fn growth(samples: &[Sample]) -> f64 {
        let (from, to) = trend(samples, "p", 300, judged_span_end(1800, 300), |s| {
            s.anon_kib
        });
        (to - from) / from
    }

    #[test]
    fn ups_and_downs_within_each_cycle_are_flat() {
        // A bump of 15% in the second minute of every cycle, as after a
        // broker cut.
        let bumpy = samples(|s| {
            if s % 300 >= 90 && s % 300 < 200 {
                18_400
            } else {
                16_000
            }
        });
        assert!(growth(&bumpy).abs() < 0.01, "{}", growth(&bumpy));
    }

    #[test]
    fn a_slow_leak_and_a_step_that_stays_are_growth() {
        let leak = samples(|s| 16_000 + s);
        assert!(growth(&leak) > 0.05, "{}", growth(&leak));
        let step = samples(|s| if s >= 1_000 { 20_000 } else { 16_000 });
        assert!(growth(&step) > 0.05, "{}", growth(&step));
    }

    #[test]
    fn the_judged_span_is_whole_cycles_after_minute_five() {
        assert_eq!(judged_span_end(1800, 300), 1800);
        assert_eq!(judged_span_end(2000, 300), 1800);
        assert_eq!(judged_span_end(900, 300), 900);
    }
}
