//! `fault-escape` (test plugin): tries to get out of the sandbox and reports
//! what happened in headers of the emitted message (the input is otherwise
//! passed on unchanged; these headers replace any of the same name):
//!
//! | header      | content                                                     |
//! |-------------|-------------------------------------------------------------|
//! | `env`       | `std::env::var("HOME")`, or `denied: <error>`               |
//! | `env-count` | how many variables `std::env::vars_os()` yields             |
//! | `fs`        | `std::fs::read_to_string("/etc/hostname")`, or `denied: <error>` |
//! | `net`       | `connected`, or `denied: <error>`, for a TCP connect to `connect` |
//!
//! Config keys:
//!
//! | key       | default       | meaning                          |
//! |-----------|---------------|----------------------------------|
//! | `connect` | `127.0.0.1:9` | address the plugin tries to reach |

use wasmrelay_plugin_sdk::prelude::*;

fn denied(err: impl std::fmt::Display) -> String {
    format!("denied: {err}")
}

struct FaultEscape;

impl Processor for FaultEscape {
    fn process(msg: Message) -> Result<Outcome, String> {
        let env = std::env::var("HOME").unwrap_or_else(denied);
        let env_count = std::env::vars_os().count();
        let fs = std::fs::read_to_string("/etc/hostname").unwrap_or_else(denied);
        let addr = config::get_or("connect", "127.0.0.1:9");
        let net = match std::net::TcpStream::connect(addr.as_str()) {
            Ok(_) => "connected".to_owned(),
            Err(e) => denied(e),
        };

        let mut out = msg.into_output();
        out.set_header("env", env);
        out.set_header("env-count", env_count.to_string());
        out.set_header("fs", fs);
        out.set_header("net", net);
        Ok(Outcome::one(out))
    }
}

export_processor!(FaultEscape);
