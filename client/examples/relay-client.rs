//! `relay-client`: connects to a wasmrelay cluster as a business process and
//! prints each delivery as one JSON line on stdout, acking it; with
//! `--reply` it first sends the value back upstream and waits for the node's
//! acknowledgement. Other events are logged on stderr.
//!
//! The nodes authenticate the process: give a token for its id with
//! `--token-file` (read again at every reconnection, so it can be
//! refreshed in place) or `--token` / `WASMRELAY_TOKEN`. A refused token
//! ends the client at once with the node's reason.
//!
//! With `--ca FILE` (and/or `--system-roots`) the client speaks TLS and
//! verifies each node's certificate for the host it dials (or for
//! `--server-name`); `--cert FILE --key FILE` adds a client certificate for
//! nodes that require one (mutual TLS).
//!
//! ```text
//! wasmrelay token issue --key client-token.key --process billing-1 --ttl 1h > billing-1.token
//! cargo run -p wasmrelay-client --example relay-client -- \
//!     --connect 127.0.0.1:7400,127.0.0.1:7401 --process-id billing-1 \
//!     --token-file billing-1.token --reply --count 10
//! cargo run -p wasmrelay-client --example relay-client -- \
//!     --connect relay-1.internal:7400 --process-id billing-1 --token-file billing-1.token \
//!     --ca ca.pem --cert billing-1.pem --key billing-1.key
//! ```

use std::io::Write as _;
use std::process::ExitCode;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use clap::{ArgGroup, Parser};
use serde_json::{Map, Value};
use wasmrelay_client::{
    Client, ClientConfig, ClientTls, Delivery, Event, OutgoingMessage, SendError, TlsError,
};

/// Connects to relay nodes as a business process and prints its deliveries
/// as JSON lines.
#[derive(Debug, Parser)]
#[command(name = "relay-client")]
#[command(group(ArgGroup::new("trust").args(["ca", "system_roots"]).multiple(true)))]
struct Args {
    /// Client addresses of relay nodes, `host:port`, comma separated; tried
    /// in order.
    #[arg(
        long,
        env = "WASMRELAY_CONNECT",
        value_delimiter = ',',
        required = true
    )]
    connect: Vec<String>,
    /// The business process id to register.
    #[arg(long, env = "WASMRELAY_PROCESS_ID")]
    process_id: String,
    /// The token for the process id (a JWT), sent in the Hello. Prefer
    /// `--token-file`: a command line is visible to other local users.
    #[arg(
        long,
        env = "WASMRELAY_TOKEN",
        hide_env_values = true,
        conflicts_with = "token_file"
    )]
    token: Option<String>,
    /// A file holding the token, read again for every connection attempt.
    #[arg(long, env = "WASMRELAY_TOKEN_FILE", value_name = "FILE")]
    token_file: Option<std::path::PathBuf>,
    /// Send each delivery's value back upstream (same key, in reply to the
    /// delivery) and wait for its acknowledgement before acking.
    #[arg(long)]
    reply: bool,
    /// Exit after this many deliveries.
    #[arg(long)]
    count: Option<u64>,
    /// Connect over TLS, trusting the CA certificates in this PEM file to
    /// sign the nodes' certificates.
    #[arg(long, env = "WASMRELAY_CA", value_name = "FILE")]
    ca: Option<std::path::PathBuf>,
    /// Connect over TLS, trusting the system's root certificates (with
    /// `--ca`, both are trusted).
    #[arg(long)]
    system_roots: bool,
    /// The client certificate chain (PEM) to present to nodes that require
    /// one (mutual TLS); needs `--key` and `--ca` or `--system-roots`.
    #[arg(
        long,
        env = "WASMRELAY_CERT",
        value_name = "FILE",
        requires = "key",
        requires = "trust"
    )]
    cert: Option<std::path::PathBuf>,
    /// The private key (PEM) of `--cert`.
    #[arg(long, env = "WASMRELAY_KEY", value_name = "FILE", requires = "cert")]
    key: Option<std::path::PathBuf>,
    /// The name the nodes' certificates must carry, instead of the host of
    /// each address dialed; needs `--ca` or `--system-roots`.
    #[arg(long, value_name = "NAME", requires = "trust")]
    server_name: Option<String>,
}

#[tokio::main]
async fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    let args = Args::parse();
    match run(args).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("relay-client: {message}");
            ExitCode::FAILURE
        }
    }
}

async fn run(args: Args) -> Result<(), String> {
    // Read before connecting: a bad file fails here, naming it.
    let tls = tls(&args).map_err(|e| e.to_string())?;
    let mut config = ClientConfig::new(args.connect, args.process_id);
    if let Some(token) = args.token {
        config = config.with_token(token);
    }
    if let Some(path) = args.token_file {
        config = config.with_token_file(path);
    }
    if let Some(tls) = tls {
        config = config.with_tls(tls);
    }
    let (client, mut events) = Client::connect(config).await.map_err(|e| e.to_string())?;
    let mut delivered = 0u64;
    if args.count == Some(0) {
        client.close().await;
        return Ok(());
    }
    loop {
        let event = tokio::select! {
            event = events.next() => event,
            _ = tokio::signal::ctrl_c() => {
                tracing::info!("interrupted; closing");
                client.close().await;
                return Err("interrupted".to_string());
            }
        };
        let Some(event) = event else {
            return Err("the client stopped".to_string());
        };
        match event {
            Event::Delivery(delivery) => {
                print_delivery(&delivery)?;
                handle(&client, delivery, args.reply).await;
                delivered += 1;
                if args.count == Some(delivered) {
                    // Writes the acks still queued before closing.
                    client.close().await;
                    return Ok(());
                }
            }
            Event::Connected { node_id } => tracing::info!(%node_id, "connected"),
            Event::Disconnected { reason } => tracing::warn!(%reason, "disconnected; reconnecting"),
            Event::Replaced { reason } => {
                return Err(format!(
                    "replaced by another connection with the same process id: {reason}"
                ));
            }
            Event::Refused { reason } => return Err(format!("refused: {reason}")),
            other => tracing::info!(event = ?other, "event"),
        }
    }
}

/// The TLS configuration the flags ask for, if any.
fn tls(args: &Args) -> Result<Option<ClientTls>, TlsError> {
    let mut tls = match (&args.ca, args.system_roots) {
        (None, false) => return Ok(None),
        (Some(ca), false) => ClientTls::with_ca_file(ca)?,
        (None, true) => ClientTls::with_system_roots()?,
        (Some(ca), true) => ClientTls::with_system_roots()?.add_ca_file(ca)?,
    };
    if let (Some(cert), Some(key)) = (&args.cert, &args.key) {
        tls = tls.with_client_cert_files(cert, key)?;
    }
    if let Some(name) = &args.server_name {
        tls = tls.with_server_name(name.clone())?;
    }
    Ok(Some(tls))
}

/// Replies if asked, then acks (or nacks when the reply was refused).
async fn handle(client: &Client, delivery: Delivery, reply: bool) {
    if reply {
        let answer = OutgoingMessage::reply_to(&delivery, delivery.message.value.clone());
        match client.send(answer).await {
            Ok(()) => {}
            Err(error @ SendError::Rejected(_)) => {
                tracing::warn!(delivery_id = %delivery.delivery_id, %error, "reply refused; nacking");
                if let Err(error) = delivery.nack(error.to_string()) {
                    tracing::warn!(%error, "nack not sent");
                }
                return;
            }
            Err(error) => {
                // The delivery is redelivered if its connection is gone;
                // otherwise nack it so that it is retried.
                tracing::warn!(delivery_id = %delivery.delivery_id, %error, "reply not sent");
                if let Err(error) = delivery.nack(error.to_string()) {
                    tracing::warn!(%error, "nack not sent");
                }
                return;
            }
        }
    }
    let delivery_id = delivery.delivery_id.clone();
    if let Err(error) = delivery.ack() {
        tracing::warn!(%delivery_id, %error, "ack not sent");
    }
}

fn print_delivery(delivery: &Delivery) -> Result<(), String> {
    let message = &delivery.message;
    let mut line = Map::new();
    line.insert("delivery_id".into(), delivery.delivery_id.clone().into());
    match &message.key {
        Some(key) => insert_bytes(&mut line, "key", key),
        None => {
            line.insert("key".into(), Value::Null);
        }
    }
    insert_bytes(&mut line, "value", &message.value);
    let mut headers = Map::new();
    let mut headers_b64 = Map::new();
    for (name, value) in &message.headers {
        match std::str::from_utf8(value) {
            Ok(text) => headers.insert(name.clone(), text.into()),
            Err(_) => headers_b64.insert(name.clone(), BASE64.encode(value).into()),
        };
    }
    line.insert("headers".into(), headers.into());
    if !headers_b64.is_empty() {
        line.insert("headers_b64".into(), headers_b64.into());
    }
    line.insert("topic".into(), message.topic.clone().into());
    line.insert("partition".into(), message.partition.into());
    line.insert("offset".into(), message.offset.into());
    line.insert("node".into(), delivery.node_id().into());
    let mut stdout = std::io::stdout().lock();
    writeln!(stdout, "{}", Value::Object(line))
        .and_then(|()| stdout.flush())
        .map_err(|e| format!("cannot write to stdout: {e}"))
}

/// `name` as UTF-8 text when it is, else `name_b64` in base64.
fn insert_bytes(line: &mut Map<String, Value>, name: &str, bytes: &[u8]) {
    match std::str::from_utf8(bytes) {
        Ok(text) => line.insert(name.to_string(), text.into()),
        Err(_) => line.insert(format!("{name}_b64"), BASE64.encode(bytes).into()),
    };
}
