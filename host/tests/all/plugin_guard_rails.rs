//! Guard rails of the plugin runtime, on real plugin components: a looping
//! plugin is stopped at its deadline, an allocating one at the memory cap, a
//! panicking one becomes an error, a plugin cannot reach outside the relay,
//! and other plugins keep being served meanwhile.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use wasmrelay::plugin::{
    Message, Outcome, PluginConfig, PluginError, PluginLimits, PluginRuntime, PluginVersion, World,
};

use crate::support;

const DEADLINE: Duration = Duration::from_millis(100);
/// Scheduling slack allowed past the deadline on a loaded 2-core machine.
const DEADLINE_MARGIN: Duration = Duration::from_millis(150);
const MEMORY_CAP: u64 = 32 * 1024 * 1024;

fn runtime() -> PluginRuntime {
    runtime_with_deadline(DEADLINE)
}

/// The memory-cap test must be stopped by the cap, not by the deadline: on a
/// loaded machine 32 one-MiB allocations can take longer than 100 ms.
fn runtime_with_deadline(call_deadline: Duration) -> PluginRuntime {
    PluginRuntime::new(PluginLimits {
        call_deadline,
        memory_cap_bytes: MEMORY_CAP,
        ..PluginLimits::default()
    })
    .unwrap()
}

fn load(runtime: &PluginRuntime, name: &str) -> PluginVersion {
    load_with(runtime, name, PluginConfig::new())
}

fn load_with(runtime: &PluginRuntime, name: &str, config: PluginConfig) -> PluginVersion {
    runtime
        .load_file(
            name,
            &support::plugin(name),
            Arc::new(config),
            Some(World::Processor),
        )
        .unwrap_or_else(|e| panic!("loading {name}: {e}"))
}

fn message(value: &str) -> Message {
    Message {
        key: Some(b"k".to_vec()),
        value: Some(value.as_bytes().to_vec()),
        headers: vec![],
        topic: "t".into(),
        partition: 0,
        offset: 1,
        timestamp_ms: None,
    }
}

/// Calls `passthrough` in a loop on another thread while `fault` runs, and
/// returns how many passthrough calls succeeded while the fault call was in
/// progress. Any failed passthrough call fails the test.
fn served_meanwhile<T>(runtime: &PluginRuntime, fault: impl FnOnce() -> T) -> (T, u64) {
    let passthrough = Arc::new(load(runtime, "passthrough"));
    let stop = Arc::new(AtomicBool::new(false));
    let served = Arc::new(AtomicU64::new(0));
    let worker = {
        let (passthrough, stop, served) = (passthrough.clone(), stop.clone(), served.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                match passthrough.process(&message("ok")) {
                    Ok(Outcome::Emit(out)) if out.len() == 1 => {
                        served.fetch_add(1, Ordering::Relaxed);
                    }
                    other => panic!("passthrough failed while a fault ran: {other:?}"),
                }
            }
        })
    };
    // Let the worker get going so "meanwhile" is measured from the fault's start.
    while served.load(Ordering::Relaxed) == 0 {
        std::thread::yield_now();
    }
    let before = served.load(Ordering::Relaxed);
    let result = fault();
    let during = served.load(Ordering::Relaxed) - before;
    stop.store(true, Ordering::Relaxed);
    worker.join().expect("passthrough worker panicked");
    (result, during)
}

/// Calls plugin `name` (which never finishes by itself) while others are
/// served: it ends as a timeout at the deadline, naming the plugin, and
/// ends so again when called again (the interrupted instance discarded).
fn assert_stopped_at_the_deadline_while_others_are_served(name: &str) {
    let runtime = runtime();
    let fault = load(&runtime, name);
    let ((error, elapsed), served) = served_meanwhile(&runtime, || {
        let started = Instant::now();
        let error = fault.process(&message("x")).unwrap_err();
        (error, started.elapsed())
    });
    assert!(
        matches!(&error, PluginError::Timeout { deadline, .. } if *deadline == DEADLINE),
        "expected a timeout, got {error:?}"
    );
    assert!(error.to_string().contains(&format!("{name}@")), "{error}");
    assert!(elapsed >= DEADLINE, "stopped early, after {elapsed:?}");
    assert!(
        elapsed < DEADLINE + DEADLINE_MARGIN,
        "stopped late, after {elapsed:?} (deadline {DEADLINE:?})"
    );
    assert!(served > 0, "no other call was served while {name} ran");
    let again = fault.process(&message("x")).unwrap_err();
    assert!(matches!(again, PluginError::Timeout { .. }), "{again:?}");
    assert_eq!(fault.stats().errors, 2);
    assert!(fault.stats().instances_created >= 2);
}

#[test]
fn looping_plugin_is_stopped_at_its_deadline_while_others_are_served() {
    assert_stopped_at_the_deadline_while_others_are_served("fault-loop");
}

#[test]
fn sleeping_plugin_is_stopped_at_its_deadline_while_others_are_served() {
    // It asks WASI's clock for an hour, a host call the epoch deadline
    // cannot interrupt: the host's clock wakes it.
    assert_stopped_at_the_deadline_while_others_are_served("fault-sleep");
}

#[test]
fn allocating_plugin_is_stopped_at_the_memory_cap_while_others_are_served() {
    let runtime = runtime_with_deadline(Duration::from_secs(30));
    let allocating = load(&runtime, "fault-alloc");
    let (error, served) =
        served_meanwhile(&runtime, || allocating.process(&message("x")).unwrap_err());
    match &error {
        PluginError::MemoryLimit {
            limit_bytes,
            version,
        } => {
            assert_eq!(*limit_bytes, MEMORY_CAP);
            assert_eq!(version.name, "fault-alloc");
        }
        other => panic!("expected the memory cap, got {other:?}"),
    }
    assert!(
        served > 0,
        "no other call was served while the plugin allocated"
    );
    let again = allocating.process(&message("x")).unwrap_err();
    assert!(
        matches!(again, PluginError::MemoryLimit { .. }),
        "{again:?}"
    );
}

#[test]
fn panicking_plugin_becomes_an_error_naming_the_panic() {
    let runtime = runtime();
    let panicking = load(&runtime, "fault-panic");
    let (error, _) = served_meanwhile(&runtime, || panicking.process(&message("x")).unwrap_err());
    match &error {
        PluginError::Trap { version, cause } => {
            assert_eq!(version.name, "fault-panic");
            assert_eq!(version.sha256.len(), 64);
            assert!(cause.contains("unreachable"), "{cause}");
            assert!(cause.contains("fault-panic: deliberate panic"), "{cause}");
        }
        other => panic!("expected a trap, got {other:?}"),
    }
    // A batch call traps as a whole, with the same kind of error.
    let batch = panicking
        .process_batch(&[message("a"), message("b")])
        .unwrap_err();
    assert!(matches!(batch, PluginError::Trap { .. }), "{batch:?}");
}

#[test]
fn plugin_cannot_read_env_files_or_open_sockets() {
    let runtime = runtime();
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.set_nonblocking(true).unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let escape = load_with(
        &runtime,
        "fault-escape",
        PluginConfig::from([("connect".to_string(), addr)]),
    );
    let Outcome::Emit(out) = escape.process(&message("x")).unwrap() else {
        panic!("fault-escape should pass its input on");
    };
    let header = |name: &str| {
        let h = out[0].headers.iter().find(|h| h.name == name).unwrap();
        String::from_utf8(h.value.clone()).unwrap()
    };
    assert!(
        header("env").starts_with("denied"),
        "env: {}",
        header("env")
    );
    assert_eq!(header("env-count"), "0");
    assert!(header("fs").starts_with("denied"), "fs: {}", header("fs"));
    assert!(
        header("net").starts_with("denied"),
        "net: {}",
        header("net")
    );
    match listener.accept() {
        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
        other => panic!("the plugin reached the listener: {other:?}"),
    }
}

#[test]
fn wrong_world_call_is_a_typed_error() {
    let runtime = runtime();
    let router = runtime
        .load_file(
            "route-by-field",
            &support::plugin("route-by-field"),
            Arc::new(PluginConfig::new()),
            None,
        )
        .unwrap();
    assert_eq!(router.world(), World::Router);
    let error = router.process(&message("x")).unwrap_err();
    assert!(matches!(error, PluginError::WrongWorld { .. }), "{error:?}");
}
