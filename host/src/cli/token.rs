//! `wasmrelay token issue`: signs a client token for a process id (or a
//! prefix pattern) with a key file, for operators and tests. The relay
//! itself only verifies tokens (`gateway::auth`).

use std::io::Write as _;
use std::process::ExitCode;

use super::TokenIssueArgs;
use crate::gateway::auth::{TokenRequest, issue_token};

/// Prints the token on stdout; errors (never the key) on stderr.
pub(crate) fn run(args: TokenIssueArgs) -> ExitCode {
    if let Err(problem) = check_process(&args.process) {
        eprintln!("error: --process: {problem}");
        return ExitCode::from(2);
    }
    let key = match std::fs::read(&args.key) {
        Ok(key) => key,
        Err(error) => {
            eprintln!(
                "error: reading the key file {}: {error}",
                args.key.display()
            );
            return ExitCode::FAILURE;
        }
    };
    let request = TokenRequest {
        alg: args.alg.into(),
        key,
        process: args.process,
        ttl: args.ttl,
        audience: args.audience,
    };
    match issue_token(&request) {
        Ok(token) => {
            let mut stdout = std::io::stdout().lock();
            if writeln!(stdout, "{token}").is_err() {
                return ExitCode::FAILURE;
            }
            ExitCode::SUCCESS
        }
        Err(error) => {
            eprintln!("error: {} ({}): {error:#}", args.key.display(), request.alg);
            ExitCode::FAILURE
        }
    }
}

/// A process id the node would accept, or a prefix pattern (`p-*`).
fn check_process(process: &str) -> Result<(), String> {
    let id = process.strip_suffix('*').unwrap_or(process);
    if id.is_empty() && process == "*" {
        return Ok(());
    }
    wasmrelay_protocol::check_process_id(id)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patterns_and_ids_are_checked_like_process_ids() {
        assert!(check_process("p-1").is_ok());
        assert!(check_process("p-*").is_ok());
        assert!(check_process("*").is_ok());
        assert!(check_process("").is_err());
        assert!(check_process("bad\nid").is_err());
    }
}
