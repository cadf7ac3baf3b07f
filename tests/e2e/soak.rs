//! The soak (`scripts/soak.sh MINUTES` runs it; ignored otherwise, it
//! takes minutes): a sidecar and a three-node cluster under steady load
//! for `WASMRELAY_SOAK_MINUTES`, with a fault every minute in turn (the
//! application away, the network to the broker cut, a node SIGKILLed and
//! restarted, a client reconnect storm, the broker frozen for 4 s). Every
//! 10 s it records each relay's RSS (and of it, anonymous memory and file
//! pages), open files, threads, tokio tasks, client connections and
//! unfinished records into `WASMRELAY_SOAK_CSV`; at the end nothing may be
//! lost, and the anonymous memory and the open files (less the client
//! connections a node holds, which move between nodes by design) of the
//! processes that ran throughout must be flat after the warm-up (growth
//! under 5% from minute 5 to the end). The RSS is reported beside, not
//! judged: most of it is the debug binary's pages.

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
        "seconds,process,rss_kib,anon_kib,file_kib,open_files,threads,tasks,connections,in_progress,awaiting_ack"
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
    let sidecar = RelayProcess::start(&sidecar_config, &[]);

    // The cluster: processes reach node-a and node-b through proxies (the
    // storm resets them); node-c is the one killed and restarted.
    let start_node = |id: &str| RelayProcess::start(&node_config(id, &kafka.bootstrap(), ""), &[]);
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
                    "{},{},{},{},{},{},{},{},{},{},{}",
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
                    s.awaiting_ack
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

    // Flat after the warm-up: the median over the first fault cycle after
    // it against the median over the last.
    let end = total.as_secs();
    // Each window is one whole cycle of the five faults (5 minutes): what a
    // node holds depends on where in the cycle it is (after a broker cut its
    // Kafka clients hold a bootstrap connection more, for example), so two
    // windows compare like with like only when each spans a cycle. The first
    // is the cycle after the warm-up (minutes 5 to 10), the last the run's
    // last cycle; a shorter run compares its second quarter with its
    // second half.
    let cycle = FAULT_EVERY.as_secs() * 5;
    let (warm, early_to, late_from) = if end >= 3 * cycle {
        (cycle, 2 * cycle, end - cycle)
    } else {
        (end / 4, end / 2, end / 2)
    };
    let mut report = Vec::new();
    for process in ["sidecar", "node-a", "node-b"] {
        // Judged: anonymous memory and open files. The RSS is shown beside
        // and not judged: most of it is the binary's pages, which grow as
        // code paths run for the first time (a fault's error paths).
        for (what, judged, field) in [
            (
                "anon_kib",
                true,
                (|s: &Sample| s.anon_kib) as fn(&Sample) -> u64,
            ),
            ("rss_kib", false, |s: &Sample| s.rss_kib),
            ("open_files_less_clients", true, Sample::files_less_clients),
        ] {
            let early = window(&samples, process, warm, early_to, field);
            let late = window(&samples, process, late_from, end + 1, field);
            let growth = (late as f64 - early as f64) / (early.max(1) as f64);
            report.push(json!({
                "process": process, "what": what, "after_warm_up": early,
                "at_the_end": late, "growth": growth, "judged": judged,
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
