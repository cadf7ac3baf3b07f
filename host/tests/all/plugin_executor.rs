//! The plugin executor on real plugin components: calls for one version
//! queued together are merged into one `process-batch` call, each caller
//! gets its own answers, and a merged call that traps is made again job by
//! job so that only the message that trapped fails.

use std::sync::Arc;
use std::time::Duration;

use wasmrelay::plugin::executor::PluginExecutor;
use wasmrelay::plugin::{
    Message, Outcome, PluginConfig, PluginError, PluginLimits, PluginRuntime, PluginVersion, World,
};

use crate::support;

fn runtime() -> PluginRuntime {
    PluginRuntime::new(PluginLimits {
        call_deadline: Duration::from_millis(200),
        ..PluginLimits::default()
    })
    .unwrap()
}

fn load(runtime: &PluginRuntime, name: &str) -> Arc<PluginVersion> {
    Arc::new(
        runtime
            .load_file(
                name,
                &support::plugin(name),
                Arc::new(PluginConfig::new()),
                Some(World::Processor),
            )
            .unwrap_or_else(|e| panic!("loading {name}: {e}")),
    )
}

fn message(value: &str) -> Message {
    Message {
        key: None,
        value: Some(value.as_bytes().to_vec()),
        headers: vec![],
        topic: "t".into(),
        partition: 0,
        offset: 0,
        timestamp_ms: None,
    }
}

/// Occupies the executor's only thread with a call that runs to its
/// deadline, so that the jobs queued meanwhile are taken together.
async fn occupy(executor: &Arc<PluginExecutor>, runtime: &PluginRuntime) {
    let looping = load(runtime, "fault-loop");
    let busy = executor.clone();
    tokio::spawn(async move { busy.process_batch(looping, vec![message("x")]).await });
    tokio::time::sleep(Duration::from_millis(50)).await;
}

fn emitted_value(answer: &Result<Outcome, PluginError>) -> String {
    match answer {
        Ok(Outcome::Emit(outputs)) => {
            String::from_utf8(outputs[0].value.clone().unwrap_or_default()).unwrap()
        }
        other => panic!("expected an emitted message, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jobs_queued_for_one_version_are_answered_from_one_call() {
    let runtime = runtime();
    let executor = Arc::new(PluginExecutor::start(1).unwrap());
    let passthrough = load(&runtime, "passthrough");
    occupy(&executor, &runtime).await;
    let jobs = (0..20).map(|n| {
        let messages = (0..3).map(|m| message(&format!("{n}.{m}"))).collect();
        executor.process_batch(passthrough.clone(), messages)
    });
    let answers = futures::future::join_all(jobs).await;
    for (n, (messages, answers)) in answers.iter().enumerate() {
        // Each job's messages come back to it, in its order.
        let given: Vec<&[u8]> = messages
            .iter()
            .map(|m| m.value.as_deref().unwrap())
            .collect();
        assert_eq!(
            given,
            [
                format!("{n}.0").as_bytes(),
                format!("{n}.1").as_bytes(),
                format!("{n}.2").as_bytes()
            ]
        );
        let answers = answers.as_ref().unwrap();
        let values: Vec<String> = answers.iter().map(emitted_value).collect();
        assert_eq!(
            values,
            [format!("{n}.0"), format!("{n}.1"), format!("{n}.2")]
        );
    }
    assert_eq!(
        passthrough.stats().calls,
        1,
        "20 jobs queued together make one call"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trap_in_a_merged_call_fails_only_the_job_that_caused_it() {
    let runtime = runtime();
    let executor = Arc::new(PluginExecutor::start(1).unwrap());
    let panicking = load(&runtime, "fault-panic");
    occupy(&executor, &runtime).await;
    let (spared, trapped, spared_too) = futures::join!(
        executor.process_batch(panicking.clone(), vec![message("spare me")]),
        executor.process_batch(panicking.clone(), vec![message("boom")]),
        executor.process_batch(panicking.clone(), vec![message("spare me")]),
    );
    assert_eq!(emitted_value(&spared.1.unwrap()[0]), "spare me");
    assert_eq!(emitted_value(&spared_too.1.unwrap()[0]), "spare me");
    // The job whose message trapped the plugin gets it back, for its
    // retry or dead letter.
    assert_eq!(trapped.0.len(), 1);
    assert_eq!(trapped.0[0].value.as_deref(), Some(&b"boom"[..]));
    match trapped.1 {
        Err(PluginError::Trap { cause, .. }) => {
            assert!(cause.contains("deliberate panic"), "{cause}")
        }
        other => panic!("expected a trap, got {other:?}"),
    }
    // The merged call, then each job alone.
    assert_eq!(panicking.stats().calls, 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_executor_with_two_threads_answers_and_is_dropped_cleanly() {
    let runtime = runtime();
    let executor = PluginExecutor::start(2).unwrap();
    let passthrough = load(&runtime, "passthrough");
    let answer = executor
        .process_batch(passthrough.clone(), vec![message("a")])
        .await
        .1
        .unwrap();
    assert_eq!(emitted_value(&answer[0]), "a");
    drop(executor);
}
