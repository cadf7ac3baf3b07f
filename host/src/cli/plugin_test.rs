//! `wasmrelay plugin test`: runs one plugin over JSON lines, with the same
//! runtime, sandbox and limits as the relay, and prints what it did with
//! each message. This is the plugin author's edit-build-test loop.

use std::io::{BufRead, BufReader, Write};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use serde_json::{Value, json};

use super::PluginTestArgs;
use super::message_json::{MessageLine, parse_message_line, render_output_message};
use crate::plugin::{
    Message, Outcome, PluginError, PluginLimits, PluginRuntime, PluginVersion, World,
};

/// Exit status when the plugin cannot be loaded.
const EXIT_LOAD_FAILED: u8 = 1;
/// Exit status for bad input or arguments.
const EXIT_BAD_INPUT: u8 = 2;

pub(super) fn run(args: PluginTestArgs) -> ExitCode {
    let limits = PluginLimits {
        call_deadline: Duration::from_millis(args.deadline_ms),
        memory_cap_bytes: args.memory_mib.saturating_mul(1024 * 1024),
        max_instances: 8,
        max_idle_instances: 1,
    };
    let runtime = match PluginRuntime::new(limits) {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("error: {error:#}");
            return ExitCode::from(EXIT_LOAD_FAILED);
        }
    };
    let name = args
        .plugin
        .file_stem()
        .and_then(|s| s.to_str())
        .unwrap_or("plugin")
        .to_string();
    let config = Arc::new(args.config.iter().cloned().collect());
    let plugin = match runtime.load_file(&name, &args.plugin, config, args.world) {
        Ok(plugin) => plugin,
        Err(error) => {
            eprintln!("error: {error}");
            return ExitCode::from(EXIT_LOAD_FAILED);
        }
    };
    tracing::info!(plugin = %plugin.label(), world = %plugin.world(), "plugin loaded");

    let input: Box<dyn BufRead> = match &args.input {
        Some(path) => match std::fs::File::open(path) {
            Ok(file) => Box::new(BufReader::new(file)),
            Err(error) => {
                eprintln!("error: opening input file {}: {error}", path.display());
                return ExitCode::from(EXIT_BAD_INPUT);
            }
        },
        None => Box::new(std::io::stdin().lock()),
    };
    let stdout = std::io::stdout();
    let mut out = std::io::BufWriter::new(stdout.lock());
    match run_lines(&plugin, input, &mut out, args.batch.map(|n| n as usize)) {
        Ok(()) => {}
        Err(RunError::Input(message)) => {
            let _ = out.flush();
            eprintln!("error: {message}");
            return ExitCode::from(EXIT_BAD_INPUT);
        }
        Err(RunError::Output(error)) => {
            eprintln!("error: writing output: {error}");
            return ExitCode::from(EXIT_BAD_INPUT);
        }
    }
    if out.flush().is_err() {
        return ExitCode::from(EXIT_BAD_INPUT);
    }
    ExitCode::SUCCESS
}

enum RunError {
    Input(String),
    Output(std::io::Error),
}

impl From<std::io::Error> for RunError {
    fn from(error: std::io::Error) -> Self {
        RunError::Output(error)
    }
}

fn run_lines(
    plugin: &PluginVersion,
    input: Box<dyn BufRead>,
    out: &mut impl Write,
    batch_size: Option<usize>,
) -> Result<(), RunError> {
    let mut pending: Vec<(u64, Message)> = Vec::new();
    for (index, line) in input.lines().enumerate() {
        let number = index as u64 + 1;
        let line =
            line.map_err(|e| RunError::Input(format!("reading input line {number}: {e}")))?;
        if line.trim().is_empty() {
            continue;
        }
        let parsed = parse_message_line(&line)
            .map_err(|e| RunError::Input(format!("input line {number}: {e}")))?;
        match (parsed, plugin.world(), batch_size) {
            (MessageLine::Message(msg), World::Processor, Some(size)) => {
                pending.push((number, msg));
                if pending.len() >= size {
                    run_batch(plugin, &mut pending, out)?;
                }
            }
            (MessageLine::Message(msg), World::Processor, None) => {
                let outcome = plugin.process(&msg);
                write_outcome(out, number, outcome)?;
            }
            (MessageLine::Message(msg), World::Router, _) => {
                let line = match plugin.route(&msg) {
                    Ok(route) => json!({"input": number, "route": route}),
                    Err(error) => error_line(number, &error),
                };
                write_line(out, &line)?;
            }
            (MessageLine::Place { process_id, nodes }, World::Router, _) => {
                let line = match plugin.place(&process_id, &nodes) {
                    Ok(node) => json!({"input": number, "place": node}),
                    Err(error) => error_line(number, &error),
                };
                write_line(out, &line)?;
            }
            (MessageLine::Place { .. }, World::Processor, _) => {
                return Err(RunError::Input(format!(
                    "input line {number}: `place` lines are for router plugins; {} is a processor",
                    plugin.label()
                )));
            }
        }
    }
    run_batch(plugin, &mut pending, out)
}

fn run_batch(
    plugin: &PluginVersion,
    pending: &mut Vec<(u64, Message)>,
    out: &mut impl Write,
) -> Result<(), RunError> {
    if pending.is_empty() {
        return Ok(());
    }
    let (numbers, batch): (Vec<u64>, Vec<Message>) = std::mem::take(pending).into_iter().unzip();
    match plugin.process_batch(&batch) {
        Ok(outcomes) => {
            for (number, outcome) in numbers.into_iter().zip(outcomes) {
                write_outcome(out, number, outcome)?;
            }
        }
        Err(error) => {
            for number in numbers {
                write_line(out, &error_line(number, &error))?;
            }
        }
    }
    Ok(())
}

fn write_outcome(
    out: &mut impl Write,
    number: u64,
    outcome: Result<Outcome, PluginError>,
) -> Result<(), RunError> {
    match outcome {
        Ok(Outcome::Emit(messages)) => {
            for msg in &messages {
                write_line(out, &render_output_message(number, msg))?;
            }
            Ok(())
        }
        Ok(Outcome::DeadLetter(reason)) => {
            write_line(out, &json!({"input": number, "dead_letter": reason}))
        }
        Err(error) => write_line(out, &error_line(number, &error)),
    }
}

fn error_line(number: u64, error: &PluginError) -> Value {
    json!({"input": number, "error": error.to_string(), "kind": error.kind()})
}

fn write_line(out: &mut impl Write, line: &Value) -> Result<(), RunError> {
    serde_json::to_writer(&mut *out, line).map_err(|e| RunError::Output(e.into()))?;
    out.write_all(b"\n")?;
    Ok(())
}
