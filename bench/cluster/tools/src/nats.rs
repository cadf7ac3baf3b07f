//! NATS side, on the plain text protocol (INFO / CONNECT / PUB / SUB / MSG /
//! PING / PONG) over tokio TCP: a publisher on one server and a subscriber
//! on another (the message crosses the cluster route between them), and
//! many idle subscribers. No client library: what is measured is the
//! server, and the loops do no more work than a client library would.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use futures::StreamExt as _;
use serde_json::json;
use tokio::io::{AsyncRead, AsyncReadExt as _, AsyncWrite, AsyncWriteExt as _, BufWriter};
use tokio::net::TcpStream;
use tokio::sync::Notify;

use crate::stats::Observations;
use crate::{emit, now_ns, read_stamp, stamped_value};

/// A protocol operation from the server.
enum Op {
    Msg(Vec<u8>),
    Ping,
    Pong,
    Other,
    Err(String),
}

/// Reads server operations from a byte stream.
struct OpReader<R> {
    read: R,
    buf: Vec<u8>,
    start: usize,
    end: usize,
}

impl<R: AsyncRead + Unpin> OpReader<R> {
    fn new(read: R, capacity: usize) -> Self {
        OpReader {
            read,
            buf: vec![0; capacity],
            start: 0,
            end: 0,
        }
    }

    /// Reads more bytes; false at the end of the stream.
    async fn fill(&mut self) -> std::io::Result<bool> {
        if self.start > 0 && self.start == self.end {
            self.start = 0;
            self.end = 0;
        }
        if self.end == self.buf.len() {
            if self.start > 0 {
                self.buf.copy_within(self.start..self.end, 0);
                self.end -= self.start;
                self.start = 0;
            } else {
                let len = self.buf.len();
                self.buf.resize(len * 2, 0);
            }
        }
        let n = self.read.read(&mut self.buf[self.end..]).await?;
        self.end += n;
        Ok(n > 0)
    }

    async fn next(&mut self) -> std::io::Result<Option<Op>> {
        loop {
            let data = &self.buf[self.start..self.end];
            if let Some(line_end) = data.windows(2).position(|w| w == b"\r\n") {
                let line = &data[..line_end];
                if line.starts_with(b"MSG ") {
                    let text = std::str::from_utf8(line).unwrap_or("");
                    let size: usize = text
                        .split_ascii_whitespace()
                        .last()
                        .and_then(|s| s.parse().ok())
                        .ok_or_else(|| std::io::Error::other(format!("bad MSG line {text:?}")))?;
                    let needed = line_end + 2 + size + 2;
                    if data.len() >= needed {
                        let payload = data[line_end + 2..line_end + 2 + size].to_vec();
                        self.start += needed;
                        return Ok(Some(Op::Msg(payload)));
                    }
                } else {
                    let op = if line.starts_with(b"PING") {
                        Op::Ping
                    } else if line.starts_with(b"PONG") {
                        Op::Pong
                    } else if line.starts_with(b"-ERR") {
                        Op::Err(String::from_utf8_lossy(line).into_owned())
                    } else {
                        Op::Other
                    };
                    self.start += line_end + 2;
                    return Ok(Some(op));
                }
            }
            if !self.fill().await? {
                return Ok(None);
            }
        }
    }
}

const CONNECT: &[u8] =
    b"CONNECT {\"verbose\":false,\"pedantic\":false,\"echo\":false,\"protocol\":1,\"name\":\"bench\"}\r\n";

/// Connects, says CONNECT (plus `extra`, e.g. a SUB) and PING, and waits for
/// the PONG.
async fn connect(
    addr: &str,
    extra: &[u8],
    buffer: usize,
) -> std::io::Result<(
    OpReader<tokio::net::tcp::OwnedReadHalf>,
    tokio::net::tcp::OwnedWriteHalf,
)> {
    let stream = TcpStream::connect(addr).await?;
    stream.set_nodelay(true)?;
    let (read, mut write) = stream.into_split();
    let mut reader = OpReader::new(read, buffer);
    let mut hello = CONNECT.to_vec();
    hello.extend_from_slice(extra);
    hello.extend_from_slice(b"PING\r\n");
    write.write_all(&hello).await?;
    loop {
        match reader.next().await? {
            Some(Op::Pong) => return Ok((reader, write)),
            Some(Op::Err(e)) => return Err(std::io::Error::other(e)),
            Some(_) => {}
            None => return Err(std::io::Error::other("the server closed the connection")),
        }
    }
}

async fn write_pub<W: AsyncWrite + Unpin>(
    writer: &mut W,
    subject: &str,
    payload: &[u8],
) -> std::io::Result<()> {
    writer
        .write_all(format!("PUB {subject} {}\r\n", payload.len()).as_bytes())
        .await?;
    writer.write_all(payload).await?;
    writer.write_all(b"\r\n").await
}

#[derive(Debug, clap::Args)]
pub(crate) struct PubSub {
    /// The server the publisher connects to (host:port).
    #[arg(long)]
    publish_to: String,
    /// The server the subscriber connects to (host:port).
    #[arg(long)]
    subscribe_to: String,
    #[arg(long)]
    count: u64,
    /// Payload size in bytes (at least 16).
    #[arg(long)]
    size: usize,
    /// Messages per second; 0 publishes as fast as the window allows.
    #[arg(long, default_value_t = 0.0)]
    rate: f64,
    /// Most messages published and not yet received (keeps the subscriber
    /// from being cut off as a slow consumer in throughput runs).
    #[arg(long, default_value_t = 10_000)]
    window: u64,
    /// Messages with a sequence number below this are left out of the
    /// latency figures.
    #[arg(long, default_value_t = 0)]
    warmup: u64,
    #[arg(long, default_value_t = 0.1)]
    steady_from: f64,
}

const PROBE: u64 = u64::MAX;

pub(crate) async fn pub_sub(args: PubSub) -> Result<(), String> {
    let subject = "bench.process";
    let received = Arc::new(AtomicU64::new(0));
    let probe_seen = Arc::new(AtomicBool::new(false));
    let notify = Arc::new(Notify::new());
    let (mut sub_reader, mut sub_writer) = connect(
        &args.subscribe_to,
        format!("SUB {subject} 1\r\n").as_bytes(),
        1 << 16,
    )
    .await
    .map_err(|e| format!("subscriber on {}: {e}", args.subscribe_to))?;
    let expected = args.count;
    let subscriber = {
        let received = received.clone();
        let probe_seen = probe_seen.clone();
        let notify = notify.clone();
        tokio::spawn(async move {
            let mut observations = Observations::default();
            let mut seen = vec![false; expected as usize];
            while received.load(Ordering::Relaxed) < expected {
                let op = match sub_reader.next().await {
                    Ok(Some(op)) => op,
                    Ok(None) => break,
                    Err(error) => {
                        eprintln!("subscriber: {error}");
                        break;
                    }
                };
                match op {
                    Op::Msg(payload) => {
                        let arrived = now_ns();
                        let Some((sent, seq)) = read_stamp(&payload) else {
                            continue;
                        };
                        if seq == PROBE {
                            probe_seen.store(true, Ordering::Relaxed);
                            continue;
                        }
                        match seen.get_mut(seq as usize) {
                            Some(flag) if !*flag => {
                                *flag = true;
                                observations.arrivals.push((seq, sent, arrived));
                                received.fetch_add(1, Ordering::Relaxed);
                                notify.notify_one();
                            }
                            _ => observations.duplicates += 1,
                        }
                    }
                    Op::Ping => {
                        let _ = sub_writer.write_all(b"PONG\r\n").await;
                    }
                    Op::Err(e) => eprintln!("subscriber: server says {e}"),
                    Op::Pong | Op::Other => {}
                }
            }
            observations
        })
    };

    let (mut pub_reader, pub_write) = connect(&args.publish_to, b"", 1 << 12)
        .await
        .map_err(|e| format!("publisher on {}: {e}", args.publish_to))?;
    let (pongs_tx, mut pongs) = tokio::sync::mpsc::unbounded_channel::<()>();
    let pub_errors = tokio::spawn(async move {
        while let Ok(Some(op)) = pub_reader.next().await {
            match op {
                Op::Err(e) => eprintln!("publisher: server says {e}"),
                Op::Pong => {
                    let _ = pongs_tx.send(());
                }
                _ => {}
            }
        }
    });
    let mut writer = BufWriter::with_capacity(1 << 16, pub_write);
    // The subscription reaches the publisher's server over the route
    // asynchronously: probe until a message gets through.
    let interest_started = Instant::now();
    while !probe_seen.load(Ordering::Relaxed) {
        write_pub(&mut writer, subject, &stamped_value(16, PROBE, now_ns()))
            .await
            .map_err(|e| e.to_string())?;
        writer.flush().await.map_err(|e| e.to_string())?;
        tokio::time::sleep(Duration::from_millis(20)).await;
        if interest_started.elapsed() > Duration::from_secs(20) {
            return Err("the subscription never reached the publisher's server".to_string());
        }
    }
    eprintln!(
        "nats: interest propagated after {:.3} s",
        interest_started.elapsed().as_secs_f64()
    );

    let started = tokio::time::Instant::now();
    let io = |e: std::io::Error| format!("publishing: {e}");
    for seq in 0..args.count {
        if args.rate > 0.0 {
            tokio::time::sleep_until(started + Duration::from_secs_f64(seq as f64 / args.rate))
                .await;
        } else {
            loop {
                let notified = notify.notified();
                if seq - received.load(Ordering::Relaxed) < args.window {
                    break;
                }
                writer.flush().await.map_err(io)?;
                notified.await;
            }
        }
        let value = stamped_value(args.size, seq, now_ns());
        write_pub(&mut writer, subject, &value).await.map_err(io)?;
        if args.rate > 0.0 {
            writer.flush().await.map_err(io)?;
        }
    }
    writer.write_all(b"PING\r\n").await.map_err(io)?;
    writer.flush().await.map_err(io)?;
    let _ = tokio::time::timeout(Duration::from_secs(30), pongs.recv()).await;
    let publish_seconds = started.elapsed().as_secs_f64();
    let mut observations = match tokio::time::timeout(Duration::from_secs(30), subscriber).await {
        Ok(Ok(observations)) => observations,
        Ok(Err(e)) => return Err(format!("subscriber task: {e}")),
        Err(_) => {
            return Err(format!(
                "the subscriber got {} of {} messages within 30 s of the last publish",
                received.load(Ordering::Relaxed),
                args.count
            ));
        }
    };
    pub_errors.abort();
    let mut summary = observations.summary(args.steady_from, args.warmup);
    summary["expected"] = json!(args.count);
    summary["publish_seconds"] = json!(publish_seconds);
    emit(summary);
    Ok(())
}

#[derive(Debug, clap::Args)]
pub(crate) struct Idle {
    /// The server (host:port).
    #[arg(long)]
    server: String,
    #[arg(long)]
    count: u64,
    /// Each connection subscribes to `<prefix><n>`.
    #[arg(long, default_value = "proc.")]
    prefix: String,
    #[arg(long, default_value_t = 0)]
    first: u64,
    #[arg(long, default_value_t = 64)]
    concurrency: usize,
    #[arg(long)]
    ready_file: Option<std::path::PathBuf>,
}

/// Keeps one idle subscriber connection: answers the server's PINGs.
async fn hold(
    mut reader: OpReader<tokio::net::tcp::OwnedReadHalf>,
    mut writer: tokio::net::tcp::OwnedWriteHalf,
    closed: Arc<AtomicU64>,
) {
    loop {
        match reader.next().await {
            Ok(Some(Op::Ping)) => {
                if writer.write_all(b"PONG\r\n").await.is_err() {
                    break;
                }
            }
            Ok(Some(_)) => {}
            Ok(None) | Err(_) => break,
        }
    }
    closed.fetch_add(1, Ordering::Relaxed);
}

pub(crate) async fn idle(args: Idle) -> Result<(), String> {
    let rss_before_kib = crate::own_rss_kib();
    let started = Instant::now();
    let closed = Arc::new(AtomicU64::new(0));
    let server = args.server.clone();
    let prefix = args.prefix.clone();
    let results: Vec<_> = futures::stream::iter(args.first..args.first + args.count)
        .map(|n| {
            let server = server.clone();
            let sub = format!("SUB {prefix}{n} 1\r\n");
            async move { connect(&server, sub.as_bytes(), 512).await }
        })
        .buffer_unordered(args.concurrency)
        .collect()
        .await;
    let mut connected = 0u64;
    let mut failed = 0u64;
    for result in results {
        match result {
            Ok((reader, writer)) => {
                connected += 1;
                tokio::spawn(hold(reader, writer, closed.clone()));
            }
            Err(error) => {
                failed += 1;
                if failed <= 5 {
                    eprintln!("nats idle: connecting failed: {error}");
                }
            }
        }
    }
    emit(json!({
        "connected": connected,
        "failed": failed,
        "connect_seconds": started.elapsed().as_secs_f64(),
        "rss_before_kib": rss_before_kib,
    }));
    if let Some(path) = &args.ready_file {
        std::fs::write(path, b"").map_err(|e| format!("writing {}: {e}", path.display()))?;
    }
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .map_err(|e| e.to_string())?;
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
    emit(json!({
        "held_seconds": started.elapsed().as_secs_f64(),
        "closed_by_server": closed.load(Ordering::Relaxed),
    }));
    if failed > 0 {
        return Err(format!("{failed} connections failed"));
    }
    Ok(())
}
