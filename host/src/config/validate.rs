//! The rules a parsed config must follow that its types cannot express:
//! names, topic names, broker addresses, properties the relay manages,
//! plugin files that must exist, URLs, durations and ranges.
//!
//! Owns: [`validate`], which checks everything and reports every problem
//! with the dotted key it is about.

use std::collections::BTreeMap;
use std::time::Duration;

use super::{
    AppTarget, CenterConfig, DeliverConfig, FlowConfig, LinkConfig, PluginsConfig, Problem,
    RelayConfig, RetryConfig, key_segment,
};

/// Longest plugin call deadline allowed.
const MAX_CALL_DEADLINE: Duration = Duration::from_secs(60);
/// Largest plugin memory cap allowed, in MiB.
const MAX_MEMORY_CAP_MIB: u64 = 4096;
/// Longest Kafka topic name.
const MAX_TOPIC_LEN: usize = 249;

/// Checks every rule on `config` and returns all the problems found, in the
/// order of the file. Also checks the file system: `plugins.dir` must be a
/// directory and every plugin a flow names must be a file in it.
pub fn validate(config: &RelayConfig) -> Result<(), Vec<Problem>> {
    let mut problems = Problems::default();
    if !is_identifier(&config.node.id) {
        problems.push("node.id", not_identifier("node id", &config.node.id));
    }
    check_admin(&config.admin, &mut problems);
    let plugin_files = check_plugins(&config.plugins, &mut problems);
    check_center(config, &mut problems);
    check_links(&config.links, &mut problems);
    if config.flows.is_empty() {
        problems.push("flows", "at least one flow (`[[flows]]`) is required");
    }
    for (index, flow) in config.flows.iter().enumerate() {
        check_flow(config, index, flow, plugin_files, &mut problems);
    }
    check_cluster(config, &mut problems);
    problems.finish()
}

/// Most admin connections a node may be told to hold open.
const MAX_ADMIN_CONNECTIONS: usize = 65_536;

/// Checks `[admin]`: an admin API off loopback needs a token unless the
/// operator opted out loudly; a token must not be blank.
fn check_admin(admin: &super::AdminConfig, problems: &mut Problems) {
    match &admin.token {
        Some(token) if token.expose().trim().is_empty() => problems.push(
            "admin.token",
            "must not be empty: set a token (e.g. `token = \"${ADMIN_TOKEN}\"` with a value \
             from `openssl rand -hex 32`), or remove the key on a loopback address",
        ),
        Some(_) if admin.allow_unauthenticated => problems.push(
            "admin.allow_unauthenticated",
            "cannot be set together with `admin.token`: remove one of them",
        ),
        Some(_) => {}
        None if !admin.on_loopback() && !admin.allow_unauthenticated => problems.push(
            "admin.listen",
            format!(
                "`{}` is not a loopback address, so the admin API needs `admin.token` \
                 (e.g. `token = \"${{ADMIN_TOKEN}}\"` with a value from `openssl rand -hex 32`); \
                 to serve metrics and state to anyone who can reach it instead, set \
                 `admin.allow_unauthenticated = true`",
                admin.listen
            ),
        ),
        None => {}
    }
    for (key, value) in [
        ("admin.header_timeout", admin.header_timeout),
        ("admin.idle_timeout", admin.idle_timeout),
    ] {
        if value.is_zero() {
            problems.push(key, "must be more than zero");
        }
    }
    if !(1..=MAX_ADMIN_CONNECTIONS).contains(&admin.max_connections) {
        problems.push(
            "admin.max_connections",
            format!("must be from 1 to {MAX_ADMIN_CONNECTIONS}"),
        );
    }
}

/// The shortest cluster secret accepted, in bytes (`openssl rand -hex 32`
/// gives 64).
const MIN_SECRET_LEN: usize = 32;
/// The placeholder of the example configs: refused, as every copy of the
/// examples would share it.
const EXAMPLE_SECRET: &str = "change-me-to-a-long-random-secret";

fn check_cluster(config: &RelayConfig, problems: &mut Problems) {
    let cluster_flows: Vec<usize> = config
        .flows
        .iter()
        .enumerate()
        .filter(|(_, f)| matches!(f.deliver, Some(DeliverConfig::Cluster(_))))
        .map(|(i, _)| i)
        .collect();
    let Some(cluster) = &config.cluster else {
        for index in cluster_flows {
            problems.push(
                format!("flows[{index}].deliver.cluster"),
                "needs a `[cluster]` section (listeners, secret, topics)",
            );
        }
        return;
    };
    match cluster_flows.as_slice() {
        [] => problems.push(
            "cluster",
            "needs exactly one flow with `[flows.deliver.cluster]` (it delivers to processes and \
             takes their upstream sends); there is none",
        ),
        [_] => {}
        [_, second, ..] => problems.push(
            format!("flows[{second}].deliver.cluster"),
            "only one flow may deliver to the cluster",
        ),
    }
    if !config.links.contains_key(&cluster.link) {
        problems.push(
            "cluster.link",
            format!("`{}` is not a link in `[links]`", cluster.link),
        );
    }
    // The secret itself is never part of a message.
    let secret = cluster.secret.expose();
    if secret.trim().eq_ignore_ascii_case(EXAMPLE_SECRET) {
        problems.push(
            "cluster.secret",
            "is the example placeholder: generate a secret of your own with `openssl rand -hex \
             32` and pass it as `${CLUSTER_SECRET}`",
        );
    } else if secret.len() < MIN_SECRET_LEN {
        problems.push(
            "cluster.secret",
            format!(
                "is {} bytes long; it must be at least {MIN_SECRET_LEN} (generate one with \
                 `openssl rand -hex 32` and pass it as `${{CLUSTER_SECRET}}`)",
                secret.len()
            ),
        );
    }
    check_client_auth(cluster, problems);
    let mut topics = vec![
        ("cluster.heartbeat_topic", &cluster.heartbeat_topic),
        ("cluster.routes_topic", &cluster.routes_topic),
    ];
    if let Some(alarm) = &cluster.alarm_topic {
        topics.push(("cluster.alarm_topic", alarm));
    }
    for (key, topic) in topics {
        if let Some(problem) = topic_problem(topic) {
            problems.push(key, problem);
        }
    }
    for (key, value) in [
        ("cluster.heartbeat_interval", cluster.heartbeat_interval),
        ("cluster.keepalive", cluster.keepalive),
        ("cluster.hello_timeout", cluster.hello_timeout),
        (
            "cluster.slow_consumer_timeout",
            cluster.slow_consumer_timeout,
        ),
        (
            "cluster.route_refresh_interval",
            cluster.route_refresh_interval,
        ),
        ("cluster.rebalance_interval", cluster.rebalance_interval),
    ] {
        if value.is_zero() {
            problems.push(key, "must be more than zero");
        }
    }
    if cluster.node_timeout < cluster.heartbeat_interval * 2 {
        problems.push(
            "cluster.node_timeout",
            format!(
                "must be at least twice `heartbeat_interval` ({:?}), or a single late heartbeat \
                 declares a node dead",
                cluster.heartbeat_interval
            ),
        );
    }
    if cluster.rebalance_rate == 0 {
        problems.push(
            "cluster.rebalance_rate",
            "must be at least 1 (processes per second)",
        );
    }
    for (key, value) in [
        ("cluster.send_queue", cluster.send_queue),
        ("cluster.max_unacked", cluster.max_unacked),
    ] {
        if value == 0 {
            problems.push(key, "must be at least 1");
        }
    }
    if !(1024..=64 * 1024 * 1024).contains(&cluster.max_frame_bytes) {
        problems.push(
            "cluster.max_frame_bytes",
            "must be from 1024 (1 KiB) to 67108864 (64 MiB)",
        );
    }
    let listeners = [
        ("cluster.client_listen", cluster.client_listen),
        ("cluster.mesh_listen", cluster.mesh_listen),
        ("admin.listen", config.admin.listen),
    ];
    for (i, (key, addr)) in listeners.iter().enumerate() {
        for (other, other_addr) in &listeners[..i] {
            if addr == other_addr && addr.port() != 0 {
                problems.push(*key, format!("is the same address as `{other}` ({addr})"));
            }
        }
    }
}

/// Problems found so far.
#[derive(Default)]
struct Problems(Vec<Problem>);

impl Problems {
    fn push(&mut self, key: impl Into<String>, problem: impl Into<String>) {
        self.0.push(Problem {
            key: key.into(),
            problem: problem.into(),
        });
    }

    fn finish(self) -> Result<(), Vec<Problem>> {
        if self.0.is_empty() {
            Ok(())
        } else {
            Err(self.0)
        }
    }
}

/// Checks `cluster.client_auth` and its keys: token mode needs a key, and
/// each key is a file or (HS256 only) an inline secret long enough. Key
/// files are read when the node starts (`gateway::auth`).
fn check_client_auth(cluster: &super::ClusterConfig, problems: &mut Problems) {
    use super::{ClientAuthMode, TokenAlgorithm};
    let keys = &cluster.client_token_keys;
    match cluster.client_auth {
        ClientAuthMode::Token if keys.is_empty() => problems.push(
            "cluster.client_token_keys",
            "`cluster.client_auth` is \"token\" (the default) and needs at least one key, e.g. \
             `client_token_keys = [{ alg = \"HS256\", path = \"/etc/wasmrelay/client-token.key\" }]` \
             (a secret from `openssl rand -hex 32`); for development only, \
             `client_auth = \"none\"` lets any client register any process id",
        ),
        ClientAuthMode::None if !keys.is_empty() => problems.push(
            "cluster.client_token_keys",
            "is set but `cluster.client_auth` is \"none\", so no token would be checked: \
             remove `client_auth = \"none\"` (token is the default) or the keys",
        ),
        ClientAuthMode::Mtls if !keys.is_empty() => problems.push(
            "cluster.client_token_keys",
            "is set but `cluster.client_auth` is \"mtls\", so no token would be checked \
             (the client certificate decides): remove the keys",
        ),
        _ => {}
    }
    if cluster.client_auth == ClientAuthMode::Mtls
        && cluster
            .tls
            .as_ref()
            .is_none_or(|tls| tls.client_ca.is_none())
    {
        problems.push(
            "cluster.client_auth",
            "is \"mtls\", which takes the process id from the client certificate: set \
             `[cluster.tls]` with `cert`, `key` and `client_ca` (the CA of the clients' \
             certificates)",
        );
    }
    for (index, key) in keys.iter().enumerate() {
        let name = format!("cluster.client_token_keys[{index}]");
        match (&key.path, &key.secret) {
            (Some(_), Some(_)) => problems.push(name, "has both `path` and `secret`: give one"),
            (None, None) => problems.push(
                name,
                "needs `path` (a key file) or, for HS256, `secret` (an inline secret)",
            ),
            (None, Some(_)) if key.alg != TokenAlgorithm::Hs256 => problems.push(
                format!("{name}.secret"),
                format!(
                    "an inline secret is for HS256 only; an {} key is a public key file: use `path`",
                    key.alg
                ),
            ),
            (None, Some(secret)) if secret.expose().len() < crate::gateway::auth::MIN_HS256_KEY_BYTES => {
                problems.push(
                    format!("{name}.secret"),
                    format!(
                        "must be at least {} bytes (use `openssl rand -hex 32`)",
                        crate::gateway::auth::MIN_HS256_KEY_BYTES
                    ),
                )
            }
            _ => {}
        }
    }
    if let Some(audience) = &cluster.client_token_audience
        && audience.trim().is_empty()
    {
        problems.push(
            "cluster.client_token_audience",
            "must not be empty: name the audience tokens must carry, or remove the key",
        );
    }
}

/// `[A-Za-z0-9._-]+`: node ids, link ids, flow names, plugin names.
fn is_identifier(name: &str) -> bool {
    !name.is_empty()
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

fn not_identifier(what: &str, name: &str) -> String {
    format!("{what} `{name}` is not valid: use one or more ASCII letters, digits, `.`, `_` or `-`")
}

/// Checks `[plugins]`. Returns whether plugin files can be checked (the
/// directory exists).
fn check_plugins(plugins: &PluginsConfig, problems: &mut Problems) -> bool {
    let dir = &plugins.dir;
    let dir_ok = match std::fs::metadata(dir) {
        Ok(meta) if meta.is_dir() => true,
        Ok(_) => {
            problems.push(
                "plugins.dir",
                format!("{} is not a directory", dir.display()),
            );
            false
        }
        Err(e) => {
            let why = if e.kind() == std::io::ErrorKind::NotFound {
                "does not exist".to_string()
            } else {
                format!("cannot be read: {e}")
            };
            problems.push("plugins.dir", format!("{} {why}", dir.display()));
            false
        }
    };
    if plugins.call_deadline.is_zero() {
        problems.push("plugins.call_deadline", "must be more than 0");
    } else if plugins.call_deadline > MAX_CALL_DEADLINE {
        problems.push(
            "plugins.call_deadline",
            format!(
                "{:?} is longer than the most allowed, {MAX_CALL_DEADLINE:?}",
                plugins.call_deadline
            ),
        );
    }
    if !(1..=MAX_MEMORY_CAP_MIB).contains(&plugins.memory_cap_mib) {
        problems.push(
            "plugins.memory_cap_mib",
            format!(
                "{} is out of range: between 1 and {MAX_MEMORY_CAP_MIB} (MiB)",
                plugins.memory_cap_mib
            ),
        );
    }
    for name in plugins.config.keys() {
        let key = format!("plugins.config.{}", key_segment(name));
        if !is_identifier(name) {
            problems.push(key, not_identifier("plugin name", name));
        } else if dir_ok && !plugins.plugin_path(name).is_file() {
            problems.push(
                key,
                format!(
                    "config for a plugin that does not exist: no file {} (is the name misspelled?)",
                    plugins.plugin_path(name).display()
                ),
            );
        }
    }
    dir_ok
}

/// Properties of a link the relay sets itself, and why.
fn managed_property(name: &str) -> Option<&'static str> {
    Some(match name {
        "bootstrap.servers" => "set it with `bootstrap_servers` in the link",
        "group.id" => {
            "the consumer group is set per flow (`group` in `[[flows]]`, by default \
             `wasmrelay-<flow name>`)"
        }
        "enable.auto.commit" | "enable.auto.offset.store" => {
            "the relay stores and commits offsets itself, only once a message is fully handled \
             (at-least-once delivery)"
        }
        "enable.partition.eof" => "the relay uses partition-EOF events to drain a link it leaves",
        "transactional.id" => "the relay configures its producers itself and uses no transactions",
        other if other.starts_with("dr_") => {
            "delivery reports belong to the relay's producer, which waits for them before an \
             input is committed"
        }
        _ => return None,
    })
}

/// What is wrong with a link option that would weaken the relay's producer
/// durability (`acks=all`, idempotence, and what idempotence needs), if
/// anything. Values that agree with it are accepted.
fn durability_problem(name: &str, value: &str) -> Option<&'static str> {
    let value = value.trim().to_ascii_lowercase();
    match name {
        "acks" | "request.required.acks" if !matches!(value.as_str(), "all" | "-1") => {
            Some("remove it, or set it to `all`")
        }
        "enable.idempotence" if value != "true" => Some("remove it"),
        "max.in.flight" | "max.in.flight.requests.per.connection"
            if !matches!(value.parse::<u32>(), Ok(1..=5)) =>
        {
            Some("an idempotent producer keeps 1 to 5 requests in flight: remove it")
        }
        "retries" | "message.send.max.retries" if matches!(value.parse::<u64>(), Ok(0)) => {
            Some("an idempotent producer retries: remove it")
        }
        _ => None,
    }
}

fn check_center(config: &RelayConfig, problems: &mut Problems) {
    let Some(center) = &config.center else {
        for (id, link) in &config.links {
            if link.from_center {
                problems.push(
                    format!("links.{}.from_center", key_segment(id)),
                    "needs a `[center]` to read `kafka.<link>` from",
                );
            }
        }
        return;
    };
    if let Some(files_dir) = center.files_dir()
        && !files_dir.is_dir()
    {
        problems.push(
            "center.files_dir",
            format!("{} is not a directory", files_dir.display()),
        );
    }
    match center {
        CenterConfig::Dir(dir) => {
            if !dir.dir.is_dir() {
                problems.push(
                    "center.dir",
                    format!("{} is not a directory", dir.dir.display()),
                );
            }
        }
        CenterConfig::Etcd(etcd) => {
            if etcd.endpoints.is_empty() {
                problems.push(
                    "center.endpoints",
                    "at least one etcd endpoint is required with `kind = \"etcd\"` \
                     (e.g. `[\"http://127.0.0.1:2379\"]`)",
                );
            }
            for (index, endpoint) in etcd.endpoints.iter().enumerate() {
                if let Err(problem) = etcd_endpoint_problem(endpoint) {
                    problems.push(format!("center.endpoints[{index}]"), problem);
                }
            }
            check_etcd_security(etcd, problems);
        }
    }
    for (key, value) in [
        ("center.wait_for_key", center.wait_for_key()),
        ("center.probe_timeout", center.probe_timeout()),
        ("center.drain_timeout", center.drain_timeout()),
    ] {
        if value.is_zero() {
            problems.push(key, "must be more than zero");
        }
    }
}

/// TLS and credentials of an etcd center: `https://` endpoints need
/// `[center.tls]` and `http://` ones must not have it (one scheme for all);
/// a password goes over TLS only, unless explicitly allowed; a client
/// certificate comes with its key.
fn check_etcd_security(etcd: &crate::config::EtcdCenterConfig, problems: &mut Problems) {
    let https = etcd
        .endpoints
        .iter()
        .filter(|e| e.to_ascii_lowercase().starts_with("https://"))
        .count();
    if https != 0 && https != etcd.endpoints.len() {
        problems.push(
            "center.endpoints",
            "mixes `https://` and plaintext endpoints; use one scheme for all",
        );
    }
    match (&etcd.tls, https) {
        (None, n) if n > 0 => problems.push(
            "center.tls",
            "`https://` endpoints need `[center.tls]` with `ca` (the CA certificate that \
             signed etcd's certificate)",
        ),
        (Some(_), 0) if !etcd.endpoints.is_empty() => problems.push(
            "center.tls",
            "is set but the endpoints are plaintext: write them as `https://host:2379`",
        ),
        _ => {}
    }
    if let Some(tls) = &etcd.tls {
        if tls.cert.is_some() != tls.key.is_some() {
            problems.push(
                "center.tls",
                "`cert` and `key` go together (the client certificate and its private key)",
            );
        }
        for (key, path) in [
            ("center.tls.ca", Some(&tls.ca)),
            ("center.tls.cert", tls.cert.as_ref()),
            ("center.tls.key", tls.key.as_ref()),
        ] {
            if let Some(path) = path
                && !path.is_file()
            {
                problems.push(key, format!("{} is not a readable file", path.display()));
            }
        }
    }
    if etcd.auth.is_some() && https == 0 && !etcd.allow_plaintext_password {
        problems.push(
            "center.auth",
            "the etcd password would cross the network in clear: use `https://` endpoints \
             with `[center.tls]`, or set `allow_plaintext_password = true` (development only)",
        );
    }
}

/// An etcd endpoint is `http://host:port` (or `https://`); a bare
/// `host:port` is taken as `http://`.
fn etcd_endpoint_problem(endpoint: &str) -> Result<(), String> {
    let with_scheme = if endpoint.contains("://") {
        endpoint.to_string()
    } else {
        format!("http://{endpoint}")
    };
    let url = url::Url::parse(&with_scheme)
        .map_err(|e| format!("`{endpoint}` is not an etcd URL like http://host:2379: {e}"))?;
    if !matches!(url.scheme(), "http" | "https") {
        return Err(format!(
            "`{endpoint}`: the scheme must be http or https, not `{}`",
            url.scheme()
        ));
    }
    if url.host_str().is_none_or(str::is_empty) {
        return Err(format!("`{endpoint}` has no host"));
    }
    Ok(())
}

fn check_links(links: &BTreeMap<String, LinkConfig>, problems: &mut Problems) {
    if links.is_empty() {
        problems.push(
            "links",
            "at least one Kafka link is required (`[links.main]` with `bootstrap_servers`)",
        );
    }
    for (id, link) in links {
        let key = format!("links.{}", key_segment(id));
        if !is_identifier(id) {
            problems.push(&key, not_identifier("link id", id));
        }
        if !link.from_center {
            for problem in bootstrap_problems(&link.bootstrap_servers) {
                problems.push(format!("{key}.bootstrap_servers"), problem);
            }
        }
        for (name, value) in &link.options {
            if let Some(why) = managed_property(name) {
                problems.push(
                    format!("{key}.options.{}", key_segment(name)),
                    format!("`{name}` is managed by the relay and cannot be set here: {why}"),
                );
            } else if let Some(why) = durability_problem(name, value) {
                problems.push(
                    format!("{key}.options.{}", key_segment(name)),
                    format!(
                        "`{name}` = `{value}` is refused: producer durability is the relay's (it \
                         always produces with acks=all and idempotence, which at-least-once \
                         delivery rests on); {why}"
                    ),
                );
            }
        }
    }
}

/// What is wrong with a `bootstrap.servers` list (`host:port,host:port`).
fn bootstrap_problems(servers: &str) -> Vec<String> {
    if servers.trim().is_empty() {
        return vec!["must list at least one broker as `host:port`".to_string()];
    }
    let mut problems = Vec::new();
    for entry in servers.split(',').map(str::trim) {
        if entry.is_empty() {
            problems.push(format!("`{servers}` has an empty entry (a stray comma?)"));
            continue;
        }
        match entry.rsplit_once(':') {
            None => problems.push(format!("`{entry}` is not `host:port`: the port is missing")),
            Some(("", _)) => problems.push(format!("`{entry}` has no host")),
            Some((_, port)) if !matches!(port.parse::<u16>(), Ok(p) if p > 0) => problems.push(
                format!("`{entry}` has no valid port: `{port}` is not a number from 1 to 65535"),
            ),
            Some(_) => {}
        }
    }
    problems
}

/// What is wrong with a Kafka topic name, if anything.
fn topic_problem(topic: &str) -> Option<String> {
    if topic.is_empty() {
        Some("must not be empty".to_string())
    } else if topic == "." || topic == ".." {
        Some(format!("`{topic}` is not allowed as a Kafka topic name"))
    } else if topic.len() > MAX_TOPIC_LEN {
        Some(format!(
            "is {} characters long; a Kafka topic name has at most {MAX_TOPIC_LEN}",
            topic.len()
        ))
    } else if !is_identifier(topic) {
        Some(format!(
            "`{topic}` is not a valid Kafka topic name: use only ASCII letters, digits, `.`, `_` \
             and `-`"
        ))
    } else {
        None
    }
}

fn check_flow(
    config: &RelayConfig,
    index: usize,
    flow: &FlowConfig,
    plugin_files: bool,
    problems: &mut Problems,
) {
    let key = format!("flows[{index}]");
    if !is_identifier(&flow.name) {
        problems.push(
            format!("{key}.name"),
            not_identifier("flow name", &flow.name),
        );
    } else if let Some(first) = config.flows[..index]
        .iter()
        .position(|f| f.name == flow.name)
    {
        problems.push(
            format!("{key}.name"),
            format!(
                "duplicate flow name `{}` (also flows[{first}].name): flow names must be unique",
                flow.name
            ),
        );
    }
    if !config.links.contains_key(&flow.link) {
        let known: Vec<String> = config.links.keys().map(|id| format!("`{id}`")).collect();
        let known = if known.is_empty() {
            "none is configured".to_string()
        } else {
            format!("configured: {}", known.join(", "))
        };
        problems.push(
            format!("{key}.link"),
            format!("no link `{}` in `[links]` ({known})", flow.link),
        );
    }
    if let Some(group) = &flow.group
        && group.trim().is_empty()
    {
        problems.push(
            format!("{key}.group"),
            format!(
                "must not be empty: remove it to use `{}`",
                FlowConfig {
                    group: None,
                    ..flow.clone()
                }
                .group_id()
            ),
        );
    }
    for (field, topic) in [
        ("input_topic", &flow.input_topic),
        ("output_topic", &flow.output_topic),
        ("dead_letter_topic", &flow.dead_letter_topic),
    ] {
        if let Some(problem) = topic_problem(topic) {
            problems.push(format!("{key}.{field}"), problem);
        }
    }
    if flow.output_topic == flow.input_topic {
        problems.push(
            format!("{key}.output_topic"),
            format!(
                "is the same as input_topic `{}`: the flow would consume its own output (a loop)",
                flow.input_topic
            ),
        );
    }
    for (field, topic) in [
        ("input_topic", &flow.input_topic),
        ("output_topic", &flow.output_topic),
    ] {
        if flow.dead_letter_topic == *topic {
            problems.push(
                format!("{key}.dead_letter_topic"),
                format!(
                    "is the same as {field} `{topic}`: dead letters must go to a topic of their own"
                ),
            );
        }
    }
    for (chain, names) in [
        ("service_call", &flow.service_call),
        ("data_return", &flow.data_return),
    ] {
        for (step, name) in names.iter().enumerate() {
            let step_key = format!("{key}.{chain}[{step}]");
            if !is_identifier(name) {
                problems.push(step_key, not_identifier("plugin name", name));
                continue;
            }
            let path = config.plugins.plugin_path(name);
            if plugin_files && !path.is_file() {
                problems.push(
                    step_key,
                    format!("plugin file {} does not exist", path.display()),
                );
            }
        }
    }
    match &flow.deliver {
        Some(DeliverConfig::App(app)) => check_app(&format!("{key}.deliver.app"), app, problems),
        Some(DeliverConfig::Cluster(target)) => {
            if target.ttl.is_zero() {
                problems.push(
                    format!("{key}.deliver.cluster.ttl"),
                    "must be more than zero",
                );
            }
            if let Some(router) = &target.router {
                let router_key = format!("{key}.deliver.cluster.router");
                if !is_identifier(router) {
                    problems.push(router_key, not_identifier("plugin name", router));
                } else if plugin_files && !config.plugins.plugin_path(router).is_file() {
                    problems.push(
                        router_key,
                        format!(
                            "plugin file {} does not exist",
                            config.plugins.plugin_path(router).display()
                        ),
                    );
                }
            }
        }
        None => {}
    }
    check_retry(&format!("{key}.retry"), &flow.retry, problems);
    if !(1..=MAX_IN_FLIGHT_LIMIT).contains(&flow.max_in_flight) {
        problems.push(
            format!("{key}.max_in_flight"),
            format!(
                "is {}: must be between 1 and {MAX_IN_FLIGHT_LIMIT}",
                flow.max_in_flight
            ),
        );
    }
}

/// The most `flows.max_in_flight` may be: each record in flight holds its
/// message and a task.
const MAX_IN_FLIGHT_LIMIT: usize = 100_000;

fn check_app(key: &str, app: &AppTarget, problems: &mut Problems) {
    // The URL itself is not repeated in messages: it may carry credentials.
    match url::Url::parse(&app.url) {
        Err(e) => problems.push(
            format!("{key}.url"),
            format!("is not a valid URL ({e}); write e.g. `http://127.0.0.1:8080/calls`"),
        ),
        Ok(url) => {
            match url.scheme() {
                "http" | "https" => {}
                other => problems.push(
                    format!("{key}.url"),
                    format!("scheme `{other}` is not supported: use an http:// or https:// URL"),
                ),
            }
            if let Some(ca) = &app.ca {
                if url.scheme() != "https" {
                    problems.push(format!("{key}.ca"), "is set but the URL is not https://");
                }
                if !ca.is_file() {
                    problems.push(
                        format!("{key}.ca"),
                        format!("{} is not a readable file", ca.display()),
                    );
                }
            }
            if url.host_str().is_none_or(str::is_empty) {
                problems.push(format!("{key}.url"), "has no host");
            }
        }
    }
    if app.timeout.is_zero() {
        problems.push(format!("{key}.timeout"), "must be more than 0");
    }
    if app.concurrency == 0 {
        problems.push(format!("{key}.concurrency"), "must be at least 1");
    }
}

fn check_retry(key: &str, retry: &RetryConfig, problems: &mut Problems) {
    if retry.initial_backoff.is_zero() {
        problems.push(format!("{key}.initial_backoff"), "must be more than 0");
        return;
    }
    if retry.max_backoff < retry.initial_backoff {
        problems.push(
            format!("{key}.max_backoff"),
            format!(
                "{:?} is less than initial_backoff ({:?})",
                retry.max_backoff, retry.initial_backoff
            ),
        );
    }
    if retry.budget < retry.initial_backoff {
        problems.push(
            format!("{key}.budget"),
            format!(
                "{:?} is less than initial_backoff ({:?}): not even one retry would fit",
                retry.budget, retry.initial_backoff
            ),
        );
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;
    use crate::config::{AdminConfig, NodeConfig};

    /// A valid config whose plugin dir is `dir` (holding `a.wasm` and
    /// `b.wasm`).
    fn valid(dir: &Path) -> RelayConfig {
        for name in ["a", "b"] {
            std::fs::write(dir.join(format!("{name}.wasm")), b"").unwrap();
        }
        let text = format!(
            r#"
[plugins]
dir = "{}"
[plugins.config.a]
x = "1"

[links.main]
bootstrap_servers = "k1:9092, k2:9093"
options = {{ "security.protocol" = "plaintext", "auto.offset.reset" = "earliest" }}

[[flows]]
name = "f"
link = "main"
input_topic = "in"
service_call = ["a"]
data_return = ["b"]
output_topic = "out"
dead_letter_topic = "dlq"
[flows.deliver.app]
url = "http://127.0.0.1:8080/calls"
"#,
            dir.display()
        );
        let config: RelayConfig = toml::from_str(&text).unwrap();
        assert_eq!(validate(&config), Ok(()));
        config
    }

    /// Runs `change` on a valid config and returns the problems as
    /// `key: problem` lines.
    fn problems(change: impl FnOnce(&mut RelayConfig)) -> Vec<String> {
        let dir = tempfile::tempdir().unwrap();
        let mut config = valid(dir.path());
        change(&mut config);
        match validate(&config) {
            Ok(()) => Vec::new(),
            Err(problems) => problems.iter().map(ToString::to_string).collect(),
        }
    }

    /// Asserts exactly one problem, for `key`, whose text contains `text`.
    #[track_caller]
    fn assert_one(found: Vec<String>, key: &str, text: &str) {
        assert_eq!(found.len(), 1, "{found:#?}");
        assert!(found[0].starts_with(&format!("{key}: ")), "{found:#?}");
        assert!(found[0].contains(text), "{found:#?}");
    }

    #[test]
    fn links_from_the_center_need_a_center_with_a_directory() {
        assert_one(
            problems(|c| c.links.get_mut("main").unwrap().from_center = true),
            "links.main.from_center",
            "needs a `[center]`",
        );
        let center = |dir: &str| {
            CenterConfig::Dir(crate::config::DirCenterConfig {
                dir: dir.into(),
                wait_for_key: std::time::Duration::from_secs(1),
                probe_timeout: std::time::Duration::from_secs(1),
                drain_timeout: std::time::Duration::from_secs(1),
                files_dir: None,
            })
        };
        assert_one(
            problems(|c| c.center = Some(center("/nonexistent/center"))),
            "center.dir",
            "not a directory",
        );
        // From the center, `bootstrap_servers` may be left out.
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().display().to_string();
        assert_eq!(
            problems(|c| {
                c.center = Some(center(&dir));
                let link = c.links.get_mut("main").unwrap();
                link.from_center = true;
                link.bootstrap_servers.clear();
            }),
            Vec::<String>::new()
        );
    }

    #[test]
    fn an_etcd_center_needs_good_endpoints() {
        let etcd = |endpoints: &[&str]| {
            CenterConfig::Etcd(crate::config::EtcdCenterConfig {
                endpoints: endpoints.iter().map(ToString::to_string).collect(),
                prefix: "/wasmrelay/".to_string(),
                auth: None,
                tls: None,
                allow_plaintext_password: false,
                wait_for_key: std::time::Duration::from_secs(1),
                probe_timeout: std::time::Duration::from_secs(1),
                drain_timeout: std::time::Duration::from_secs(1),
                files_dir: None,
            })
        };
        assert_eq!(
            problems(|c| c.center = Some(etcd(&["http://10.0.0.5:2379", "etcd-2:2379"]))),
            Vec::<String>::new()
        );
        assert_one(
            problems(|c| c.center = Some(etcd(&[]))),
            "center.endpoints",
            "at least one etcd endpoint",
        );
        assert_one(
            problems(|c| c.center = Some(etcd(&["grpc://etcd:2379"]))),
            "center.endpoints[0]",
            "scheme must be http or https",
        );
        assert_one(
            problems(|c| c.center = Some(etcd(&["http://:2379"]))),
            "center.endpoints[0]",
            "not an etcd URL",
        );
    }

    #[test]
    fn an_etcd_password_needs_tls_and_https_needs_a_ca() {
        let ca = tempfile::NamedTempFile::new().unwrap();
        let etcd = |endpoint: &str, tls: bool, auth: bool, allow: bool| {
            CenterConfig::Etcd(crate::config::EtcdCenterConfig {
                endpoints: vec![endpoint.to_string()],
                prefix: "/wasmrelay/".to_string(),
                auth: auth.then(|| crate::config::EtcdAuth {
                    user: "relay".into(),
                    password: crate::config::Secret::new("Pa55-in-clear"),
                }),
                tls: tls.then(|| crate::config::EtcdTls {
                    ca: ca.path().to_path_buf(),
                    cert: None,
                    key: None,
                    domain: None,
                }),
                allow_plaintext_password: allow,
                wait_for_key: std::time::Duration::from_secs(1),
                probe_timeout: std::time::Duration::from_secs(1),
                drain_timeout: std::time::Duration::from_secs(1),
                files_dir: None,
            })
        };
        let plain = "http://10.0.0.5:2379";
        let tls = "https://10.0.0.5:2379";
        let refused = problems(|c| c.center = Some(etcd(plain, false, true, false)));
        assert_one(refused.clone(), "center.auth", "allow_plaintext_password");
        assert!(!format!("{refused:?}").contains("Pa55-in-clear"));
        assert_eq!(
            problems(|c| c.center = Some(etcd(plain, false, true, true))),
            Vec::<String>::new()
        );
        assert_eq!(
            problems(|c| c.center = Some(etcd(tls, true, true, false))),
            Vec::<String>::new()
        );
        assert_one(
            problems(|c| c.center = Some(etcd(tls, false, false, false))),
            "center.tls",
            "need `[center.tls]`",
        );
        assert_one(
            problems(|c| c.center = Some(etcd(plain, true, false, false))),
            "center.tls",
            "endpoints are plaintext",
        );
    }

    fn cluster(config: &mut RelayConfig) -> &mut crate::config::ClusterConfig {
        config.flows[0].deliver = Some(DeliverConfig::Cluster(crate::config::ClusterTarget {
            router: None,
            ttl: Duration::from_secs(30),
        }));
        let text = r#"
link = "main"
client_listen = "127.0.0.1:7000"
mesh_listen = "127.0.0.1:7001"
secret = "0123456789abcdef0123456789abcdef"
client_token_keys = [{ alg = "HS256", secret = "0123456789abcdef0123456789abcdef" }]
"#;
        config.cluster = Some(toml::from_str(text).unwrap());
        config.cluster.as_mut().unwrap()
    }

    #[test]
    fn a_cluster_flow_needs_a_cluster_and_a_cluster_a_flow() {
        assert_eq!(
            problems(|c| {
                cluster(c);
            }),
            Vec::<String>::new()
        );
        assert_one(
            problems(|c| {
                cluster(c);
                c.cluster = None;
            }),
            "flows[0].deliver.cluster",
            "needs a `[cluster]`",
        );
        assert_one(
            problems(|c| {
                cluster(c);
                c.flows[0].deliver = None;
            }),
            "cluster",
            "exactly one flow",
        );
    }

    #[test]
    fn client_auth_needs_keys_and_each_key_one_source() {
        use crate::config::{ClientAuthMode, Secret, TokenAlgorithm, TokenKeyConfig};
        let listener_tls = |client_ca: Option<&str>| {
            Some(crate::config::ListenerTlsConfig {
                cert: "node.crt".into(),
                key: "node.key".into(),
                client_ca: client_ca.map(Into::into),
            })
        };
        let key = |alg, path: Option<&str>, secret: Option<&str>| TokenKeyConfig {
            alg,
            path: path.map(Into::into),
            secret: secret.map(Secret::new),
        };
        assert_one(
            problems(|c| cluster(c).client_token_keys.clear()),
            "cluster.client_token_keys",
            "needs at least one key",
        );
        assert_one(
            problems(|c| cluster(c).client_auth = ClientAuthMode::None),
            "cluster.client_token_keys",
            "no token would be checked",
        );
        assert_eq!(
            problems(|c| {
                let cluster = cluster(c);
                cluster.client_auth = ClientAuthMode::None;
                cluster.client_token_keys.clear();
            }),
            Vec::<String>::new()
        );
        assert_one(
            problems(|c| {
                let cluster = cluster(c);
                cluster.client_auth = ClientAuthMode::Mtls;
                cluster.client_token_keys.clear();
                cluster.tls = listener_tls(None);
            }),
            "cluster.client_auth",
            "client_ca",
        );
        assert_one(
            problems(|c| {
                let cluster = cluster(c);
                cluster.client_auth = ClientAuthMode::Mtls;
                cluster.tls = listener_tls(Some("clients-ca.crt"));
            }),
            "cluster.client_token_keys",
            "the client certificate decides",
        );
        assert_eq!(
            problems(|c| {
                let cluster = cluster(c);
                cluster.client_auth = ClientAuthMode::Mtls;
                cluster.client_token_keys.clear();
                cluster.tls = listener_tls(Some("clients-ca.crt"));
            }),
            Vec::<String>::new()
        );
        assert_one(
            problems(|c| {
                cluster(c).client_token_keys = vec![key(TokenAlgorithm::Hs256, None, Some("short"))]
            }),
            "cluster.client_token_keys[0].secret",
            "at least 32 bytes",
        );
        assert_one(
            problems(|c| {
                cluster(c).client_token_keys = vec![key(
                    TokenAlgorithm::EdDsa,
                    None,
                    Some("0123456789abcdef0123456789abcdef"),
                )]
            }),
            "cluster.client_token_keys[0].secret",
            "HS256 only",
        );
        assert_one(
            problems(|c| {
                cluster(c).client_token_keys =
                    vec![key(TokenAlgorithm::Hs256, Some("/k"), Some("x"))]
            }),
            "cluster.client_token_keys[0]",
            "both `path` and `secret`",
        );
        assert_one(
            problems(|c| {
                cluster(c).client_token_keys = vec![key(TokenAlgorithm::EdDsa, None, None)]
            }),
            "cluster.client_token_keys[0]",
            "needs `path`",
        );
        assert_one(
            problems(|c| cluster(c).client_token_audience = Some(" ".to_string())),
            "cluster.client_token_audience",
            "must not be empty",
        );
        let parsed: TokenKeyConfig =
            toml::from_str("alg = \"EdDSA\"\npath = \"/etc/issuer.pub.pem\"").unwrap();
        assert_eq!(parsed.alg, TokenAlgorithm::EdDsa);
        assert!(toml::from_str::<TokenKeyConfig>("alg = \"RS256\"\npath = \"/k\"").is_err());
    }

    #[test]
    fn a_cluster_secret_is_32_bytes_or_more_and_not_the_example_placeholder() {
        let secret = |s: &str| {
            let s = s.to_string();
            problems(move |c| cluster(c).secret = s.into())
        };
        for short in ["short", "0123456789abcdef", &"x".repeat(31)] {
            let found = secret(short);
            assert_one(found.clone(), "cluster.secret", "must be at least 32");
            assert!(found[0].contains("openssl rand -hex 32"), "{found:#?}");
            assert!(
                short.len() < 8 || !found[0].contains(short),
                "the secret is quoted: {found:#?}"
            );
        }
        for placeholder in [
            "change-me-to-a-long-random-secret",
            " CHANGE-ME-to-a-long-random-secret ",
        ] {
            let found = secret(placeholder);
            assert_one(found.clone(), "cluster.secret", "the example placeholder");
            assert!(!found[0].contains("change-me"), "{found:#?}");
        }
        assert_eq!(secret(&"x".repeat(32)), Vec::<String>::new());
        // Bytes, not characters: 11 three-byte characters are 33 bytes.
        assert_eq!(secret(&"€".repeat(11)), Vec::<String>::new());
    }

    #[test]
    fn link_options_cannot_weaken_producer_durability() {
        let with = |name: &str, value: &str| {
            let (name, value) = (name.to_string(), value.to_string());
            problems(move |c| {
                let options = &mut c.links.get_mut("main").unwrap().options;
                options.insert(name, value);
            })
        };
        for (name, value) in [
            ("acks", "0"),
            ("acks", "1"),
            ("request.required.acks", "1"),
            ("enable.idempotence", "false"),
            ("max.in.flight.requests.per.connection", "10"),
            ("max.in.flight", "0"),
            ("retries", "0"),
            ("message.send.max.retries", "0"),
        ] {
            let key = format!("links.main.options.{}", key_segment(name));
            let found = with(name, value);
            assert_one(found.clone(), &key, "producer durability is the relay's");
            assert!(
                found[0].contains(&format!("`{name}` = `{value}`")),
                "{found:#?}"
            );
        }
        for (name, value) in [
            ("acks", "all"),
            ("acks", "-1"),
            ("request.required.acks", "ALL"),
            ("enable.idempotence", "true"),
            ("max.in.flight.requests.per.connection", "5"),
            ("retries", "10"),
        ] {
            assert_eq!(with(name, value), Vec::<String>::new(), "{name}={value}");
        }
    }

    #[test]
    fn a_center_files_dir_must_be_a_directory() {
        let tmp = tempfile::tempdir().unwrap();
        let center = |files_dir: std::path::PathBuf| {
            CenterConfig::Dir(crate::config::DirCenterConfig {
                dir: tmp.path().into(),
                wait_for_key: Duration::from_secs(1),
                probe_timeout: Duration::from_secs(1),
                drain_timeout: Duration::from_secs(1),
                files_dir: Some(files_dir),
            })
        };
        let ok = center(tmp.path().into());
        assert_eq!(problems(|c| c.center = Some(ok)), Vec::<String>::new());
        let missing = center(tmp.path().join("missing"));
        assert_one(
            problems(|c| c.center = Some(missing)),
            "center.files_dir",
            "missing is not a directory",
        );
    }

    #[test]
    fn cluster_settings_are_checked() {
        assert_one(
            problems(|c| cluster(c).link = "other".to_string()),
            "cluster.link",
            "not a link",
        );
        assert_one(
            problems(|c| cluster(c).node_timeout = Duration::from_millis(1500)),
            "cluster.node_timeout",
            "twice",
        );
        assert_one(
            problems(|c| cluster(c).mesh_listen = "127.0.0.1:7000".parse().unwrap()),
            "cluster.mesh_listen",
            "same address as `cluster.client_listen`",
        );
        assert_one(
            problems(|c| cluster(c).routes_topic = "bad topic".to_string()),
            "cluster.routes_topic",
            "not a valid Kafka topic name",
        );
        assert_one(
            problems(|c| cluster(c).max_frame_bytes = 10),
            "cluster.max_frame_bytes",
            "1024",
        );
        assert_one(
            problems(|c| {
                cluster(c);
                if let Some(DeliverConfig::Cluster(target)) = &mut c.flows[0].deliver {
                    target.router = Some("no-such-router".to_string());
                }
            }),
            "flows[0].deliver.cluster.router",
            "does not exist",
        );
    }

    fn app(config: &mut RelayConfig) -> &mut AppTarget {
        match config.flows[0].deliver.as_mut() {
            Some(DeliverConfig::App(app)) => app,
            _ => panic!("no app target"),
        }
    }

    #[test]
    fn links_must_not_be_empty() {
        let found = problems(|c| c.links.clear());
        assert!(
            found[0].starts_with("links: at least one Kafka link"),
            "{found:#?}"
        );
    }

    #[test]
    fn link_ids_must_be_identifiers() {
        let found = problems(|c| {
            let link = c.links.remove("main").unwrap();
            c.links.insert("main link".into(), link);
            c.flows[0].link = "main link".into();
        });
        assert_one(
            found,
            "links.\"main link\"",
            "link id `main link` is not valid",
        );
    }

    #[test]
    fn bootstrap_servers_must_be_host_port_lists() {
        let set = |servers: &'static str| {
            problems(move |c| {
                c.links.get_mut("main").unwrap().bootstrap_servers = servers.into();
            })
        };
        let key = "links.main.bootstrap_servers";
        assert_one(set(""), key, "at least one broker");
        assert_one(set("k1:9092,"), key, "empty entry");
        assert_one(set("k1"), key, "`k1` is not `host:port`");
        assert_one(set(":9092"), key, "has no host");
        assert_one(set("k1:kafka"), key, "`kafka` is not a number");
        assert_one(set("k1:0"), key, "no valid port");
        assert_one(set("k1:70000"), key, "no valid port");
        assert_eq!(set("[::1]:9092,k2:1"), Vec::<String>::new());
        assert_eq!(set("k1:9092,k2:9092,k3:9092").len(), 0);
        assert_eq!(set("k1, k2:9").len(), 1);
    }

    #[test]
    fn managed_link_options_are_refused() {
        for (name, why) in [
            ("bootstrap.servers", "`bootstrap_servers`"),
            ("group.id", "per flow"),
            ("enable.auto.commit", "commits offsets itself"),
            ("enable.auto.offset.store", "commits offsets itself"),
            ("enable.partition.eof", "drain"),
            ("transactional.id", "no transactions"),
            ("dr_msg_cb", "delivery reports"),
        ] {
            assert_eq!(name.contains('.'), key_segment(name).starts_with('"'));
            let found = problems(|c| {
                let options = &mut c.links.get_mut("main").unwrap().options;
                options.insert(name.into(), "x".into());
            });
            let key = format!("links.main.options.{}", key_segment(name));
            assert_one(found, &key, why);
        }
        // auto.offset.reset (in `valid`) and other properties pass.
    }

    #[test]
    fn flows_must_not_be_empty() {
        let found = problems(|c| c.flows.clear());
        assert_one(found, "flows", "at least one flow");
    }

    #[test]
    fn flow_names_must_be_valid_and_unique() {
        assert_one(
            problems(|c| c.flows[0].name = "a b".into()),
            "flows[0].name",
            "flow name `a b` is not valid",
        );
        let found = problems(|c| {
            let mut second = c.flows[0].clone();
            second.input_topic = "in2".into();
            c.flows.push(second);
        });
        assert_one(
            found,
            "flows[1].name",
            "duplicate flow name `f` (also flows[0].name)",
        );
    }

    #[test]
    fn flow_link_must_exist() {
        assert_one(
            problems(|c| c.flows[0].link = "other".into()),
            "flows[0].link",
            "no link `other` in `[links]` (configured: `main`)",
        );
    }

    #[test]
    fn group_must_not_be_empty() {
        assert_one(
            problems(|c| c.flows[0].group = Some(String::new())),
            "flows[0].group",
            "remove it to use `wasmrelay-f`",
        );
    }

    #[test]
    fn topics_must_be_valid_kafka_names() {
        assert_one(
            problems(|c| c.flows[0].input_topic = "in put".into()),
            "flows[0].input_topic",
            "not a valid Kafka topic name",
        );
        assert_one(
            problems(|c| c.flows[0].output_topic = "..".into()),
            "flows[0].output_topic",
            "`..` is not allowed",
        );
        assert_one(
            problems(|c| c.flows[0].dead_letter_topic = String::new()),
            "flows[0].dead_letter_topic",
            "must not be empty",
        );
        assert_one(
            problems(|c| c.flows[0].input_topic = "t".repeat(250)),
            "flows[0].input_topic",
            "250 characters long",
        );
        assert_eq!(
            problems(|c| c.flows[0].input_topic = "t".repeat(249)),
            Vec::<String>::new()
        );
        assert_eq!(
            problems(|c| c.flows[0].input_topic = "a.B_c-9".into()),
            Vec::<String>::new()
        );
    }

    #[test]
    fn topics_must_not_loop() {
        assert_one(
            problems(|c| c.flows[0].output_topic = "in".into()),
            "flows[0].output_topic",
            "a loop",
        );
        assert_one(
            problems(|c| c.flows[0].dead_letter_topic = "in".into()),
            "flows[0].dead_letter_topic",
            "same as input_topic `in`",
        );
        assert_one(
            problems(|c| c.flows[0].dead_letter_topic = "out".into()),
            "flows[0].dead_letter_topic",
            "same as output_topic `out`",
        );
    }

    #[test]
    fn plugin_files_must_exist() {
        let found = problems(|c| {
            c.flows[0].service_call = vec!["a".into(), "json-enrich".into()];
        });
        assert_eq!(found.len(), 1, "{found:#?}");
        assert!(
            found[0].starts_with("flows[0].service_call[1]: plugin file /"),
            "{found:#?}"
        );
        assert!(
            found[0].ends_with("/json-enrich.wasm does not exist"),
            "{found:#?}"
        );
        assert_one(
            problems(|c| c.flows[0].data_return = vec!["../b".into()]),
            "flows[0].data_return[0]",
            "plugin name `../b` is not valid",
        );
        // A directory named like a plugin is not a plugin file.
        let found = problems(|c| {
            std::fs::create_dir(c.plugins.dir.join("d.wasm")).unwrap();
            c.flows[0].data_return = vec!["d".into()];
        });
        assert_one(found, "flows[0].data_return[0]", "d.wasm does not exist");
    }

    #[test]
    fn plugins_dir_must_be_a_directory() {
        let found = problems(|c| c.plugins.dir = c.plugins.dir.join("missing"));
        // Plugin files are not checked (again) when the directory is missing.
        assert_one(found, "plugins.dir", "missing does not exist");
        let found = problems(|c| c.plugins.dir = c.plugins.dir.join("a.wasm"));
        assert_one(found, "plugins.dir", "a.wasm is not a directory");
    }

    #[test]
    fn plugin_config_must_name_an_existing_plugin() {
        let found = problems(|c| {
            c.plugins
                .config
                .insert("json-enrih".into(), BTreeMap::new());
        });
        assert_one(
            found,
            "plugins.config.json-enrih",
            "json-enrih.wasm (is the name misspelled?)",
        );
        // Config for a plugin that exists but no flow uses (a router, say) is fine.
        assert_eq!(
            problems(|c| {
                c.flows[0].data_return.clear();
                c.plugins.config.insert("b".into(), BTreeMap::new());
            }),
            Vec::<String>::new()
        );
    }

    #[test]
    fn app_url_must_be_http_with_a_host() {
        let set = |url: &'static str| problems(move |c| app(c).url = url.into());
        let key = "flows[0].deliver.app.url";
        assert_one(
            set("not a url"),
            key,
            "is not a valid URL (relative URL without a base)",
        );
        assert_eq!(set("https://app:8443/"), Vec::<String>::new());
        assert_one(set("ftp://app/"), key, "scheme `ftp` is not supported");
        assert_one(set("http://:8080/"), key, "is not a valid URL (empty host)");
        assert_eq!(set("http://[::1]:8080/x?y=1"), Vec::<String>::new());
    }

    #[test]
    fn app_timeout_and_concurrency_must_be_positive() {
        assert_one(
            problems(|c| app(c).timeout = Duration::ZERO),
            "flows[0].deliver.app.timeout",
            "more than 0",
        );
        assert_one(
            problems(|c| app(c).concurrency = 0),
            "flows[0].deliver.app.concurrency",
            "at least 1",
        );
    }

    #[test]
    fn max_in_flight_must_be_in_range() {
        assert_one(
            problems(|c| c.flows[0].max_in_flight = 0),
            "flows[0].max_in_flight",
            "is 0: must be between 1 and 100000",
        );
        assert_one(
            problems(|c| c.flows[0].max_in_flight = 1_000_000),
            "flows[0].max_in_flight",
            "must be between 1 and 100000",
        );
    }

    #[test]
    fn retry_durations_must_be_ordered() {
        let retry = |initial: u64, max: u64, budget: u64| {
            problems(move |c| {
                c.flows[0].retry = RetryConfig {
                    initial_backoff: Duration::from_millis(initial),
                    max_backoff: Duration::from_millis(max),
                    budget: Duration::from_millis(budget),
                }
            })
        };
        assert_one(
            retry(0, 10, 10),
            "flows[0].retry.initial_backoff",
            "more than 0",
        );
        assert_one(
            retry(100, 50, 1000),
            "flows[0].retry.max_backoff",
            "50ms is less than initial_backoff (100ms)",
        );
        assert_one(
            retry(100, 500, 99),
            "flows[0].retry.budget",
            "not even one retry",
        );
        assert_eq!(retry(100, 100, 100), Vec::<String>::new());
    }

    #[test]
    fn call_deadline_is_bounded() {
        assert_one(
            problems(|c| c.plugins.call_deadline = Duration::ZERO),
            "plugins.call_deadline",
            "more than 0",
        );
        assert_one(
            problems(|c| c.plugins.call_deadline = Duration::from_secs(61)),
            "plugins.call_deadline",
            "61s is longer than the most allowed, 60s",
        );
        assert_eq!(
            problems(|c| c.plugins.call_deadline = Duration::from_secs(60)),
            Vec::<String>::new()
        );
    }

    #[test]
    fn memory_cap_is_bounded() {
        for bad in [0, 4097] {
            assert_one(
                problems(|c| c.plugins.memory_cap_mib = bad),
                "plugins.memory_cap_mib",
                "out of range",
            );
        }
        for good in [1, 4096] {
            assert_eq!(
                problems(|c| c.plugins.memory_cap_mib = good),
                Vec::<String>::new()
            );
        }
    }

    #[test]
    fn node_id_must_be_an_identifier() {
        assert_one(
            problems(|c| {
                c.node = NodeConfig {
                    id: "node 1".into(),
                }
            }),
            "node.id",
            "node id `node 1` is not valid",
        );
    }

    #[test]
    fn admin_token_must_not_be_empty_when_set() {
        let token = |t: Option<&str>| {
            problems(move |c| {
                c.admin = AdminConfig {
                    token: t.map(|t| t.to_string().into()),
                    ..AdminConfig::default()
                }
            })
        };
        assert_one(token(Some("")), "admin.token", "must not be empty");
        assert_one(token(Some("  ")), "admin.token", "must not be empty");
        assert_eq!(token(Some("s3cret")), Vec::<String>::new());
        assert_eq!(token(None), Vec::<String>::new());
    }

    /// `[admin]` with `listen`, `token` and `allow_unauthenticated` set.
    fn admin_problems(listen: &str, token: Option<&str>, allow: bool) -> Vec<String> {
        let listen = listen.parse().unwrap();
        let token = token.map(|t| t.to_string().into());
        problems(move |c| {
            c.admin = AdminConfig {
                listen,
                token,
                allow_unauthenticated: allow,
                ..AdminConfig::default()
            }
        })
    }

    #[test]
    fn an_admin_api_off_loopback_needs_a_token_or_the_explicit_opt_in() {
        for listen in [
            "0.0.0.0:9464",
            "10.1.2.3:9464",
            "[::]:9464",
            "192.168.0.7:0",
        ] {
            let found = admin_problems(listen, None, false);
            assert_one(found.clone(), "admin.listen", "is not a loopback address");
            assert!(found[0].contains("admin.token"), "{found:#?}");
            assert!(found[0].contains("allow_unauthenticated"), "{found:#?}");
            assert_eq!(
                admin_problems(listen, Some("s3cret"), false),
                Vec::<String>::new()
            );
            assert_eq!(admin_problems(listen, None, true), Vec::<String>::new());
        }
        for listen in [
            "127.0.0.1:9464",
            "127.0.0.2:0",
            "[::1]:9464",
            "[::ffff:127.0.0.1]:9464",
        ] {
            assert_eq!(
                admin_problems(listen, None, false),
                Vec::<String>::new(),
                "{listen}"
            );
        }
    }

    /// The relay config embedded in the Kubernetes example, its paths
    /// pointed at `plugins` and `center`.
    fn kubernetes_example(plugins: &Path, center: &Path) -> String {
        let manifest = std::fs::read_to_string(
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/kubernetes/sidecar.yaml"),
        )
        .unwrap();
        let start = manifest.find("  relay.toml: |\n").unwrap() + "  relay.toml: |\n".len();
        let end = start + manifest[start..].find("\n---").unwrap();
        manifest[start..end]
            .lines()
            .map(|line| line.strip_prefix("    ").unwrap_or(line))
            .collect::<Vec<_>>()
            .join("\n")
            .replace("\"/plugins\"", &format!("\"{}\"", plugins.display()))
            .replace(
                "\"/etc/wasmrelay/center\"",
                &format!("\"{}\"", center.display()),
            )
    }

    #[test]
    fn the_kubernetes_example_takes_its_admin_token_from_the_environment() {
        let plugins = tempfile::tempdir().unwrap();
        for name in ["json-enrich", "mask-fields"] {
            std::fs::write(plugins.path().join(format!("{name}.wasm")), b"").unwrap();
        }
        let center = tempfile::tempdir().unwrap();
        let text = kubernetes_example(plugins.path(), center.path());
        let env = |name: &str| match name {
            "POD_NAME" => Some("orders-7".to_string()),
            "ADMIN_TOKEN" => Some("0123456789abcdef0123456789abcdef".to_string()),
            _ => None,
        };
        let config = crate::config::parse(&text, "sidecar.yaml", &env).unwrap();
        assert!(!config.admin.on_loopback(), "{}", config.admin.listen);
        assert_eq!(
            config.admin.token.as_ref().map(|t| t.expose()),
            Some("0123456789abcdef0123456789abcdef")
        );
        assert!(!config.admin.allow_unauthenticated);
        // Without the Secret's variable it does not start.
        let unset = |name: &str| (name == "POD_NAME").then(|| "orders-7".to_string());
        let error = crate::config::parse(&text, "sidecar.yaml", &unset)
            .unwrap_err()
            .to_string();
        assert!(error.contains("ADMIN_TOKEN"), "{error}");
    }

    #[test]
    fn an_admin_token_and_the_opt_out_together_are_refused() {
        assert_one(
            admin_problems("0.0.0.0:9464", Some("s3cret"), true),
            "admin.allow_unauthenticated",
            "cannot be set together with `admin.token`",
        );
    }

    #[test]
    fn admin_timeouts_and_the_connection_cap_must_be_positive() {
        let with = |f: fn(&mut AdminConfig)| {
            problems(move |c| {
                let mut admin = AdminConfig::default();
                f(&mut admin);
                c.admin = admin;
            })
        };
        assert_one(
            with(|a| a.header_timeout = Duration::ZERO),
            "admin.header_timeout",
            "must be more than zero",
        );
        assert_one(
            with(|a| a.idle_timeout = Duration::ZERO),
            "admin.idle_timeout",
            "must be more than zero",
        );
        assert_one(
            with(|a| a.max_connections = 0),
            "admin.max_connections",
            "must be from 1 to 65536",
        );
        assert_eq!(with(|a| a.max_connections = 1), Vec::<String>::new());
    }
}
