//! The node's Kafka links at start: the config center (when one is
//! configured), each link's connection info (from the config file or the
//! center's `kafka.<link>` key), the topics the relay writes to, and the
//! followers that switch a link when its key changes.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::center::{ConfigCenter, Reachability};
use crate::config::{CenterConfig, LinkConfig, RelayConfig};
use crate::kafka::admin::{TopicSpec, ensure_topics};
use crate::kafka::probe::probe_cluster;
use crate::kafka::{CenterPolicy, LinkInfo};
use crate::link::KafkaLink;

/// Partitions of a topic the relay creates (dead-letter, output).
const CREATED_TOPIC_PARTITIONS: i32 = 3;
/// How long creating topics may take at start-up.
const TOPIC_CREATION_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a failed link start is given to say why its cluster does not
/// answer.
const PROBE_ON_ERROR_TIMEOUT: Duration = Duration::from_secs(5);

/// The topics the relay writes to through link `id` (created when missing).
/// On the cluster's link, the cluster's own topics too.
pub(super) fn owned_topics(config: &RelayConfig, id: &str) -> Vec<TopicSpec> {
    let mut topics: Vec<TopicSpec> = config
        .flows
        .iter()
        .filter(|f| f.link == id)
        .flat_map(|f| [f.output_topic.clone(), f.dead_letter_topic.clone()])
        .map(|t| TopicSpec::new(t, CREATED_TOPIC_PARTITIONS))
        .collect();
    if let Some(cluster) = config.cluster.as_ref().filter(|c| c.link == id) {
        topics.extend(crate::cluster::runtime::cluster_topics(cluster));
    }
    topics
}

/// What the center's values may set: connection properties, and files only
/// inside the center's `files_dir`.
pub(super) fn center_policy(center: &CenterConfig) -> CenterPolicy {
    CenterPolicy {
        files_dir: center.files_dir().map(Into::into),
    }
}

/// Starts the config center; its task runs on `tasks` until `stop`.
pub(super) async fn start_center(
    center: &CenterConfig,
    tasks: &TaskTracker,
    stop: CancellationToken,
) -> anyhow::Result<ConfigCenter> {
    let started = match center {
        CenterConfig::Dir(dir) => crate::center::dir::start(&dir.dir, tasks, stop).await?,
        CenterConfig::Etcd(etcd) => {
            if etcd.auth.is_some() && etcd.tls.is_none() {
                tracing::warn!(
                    "INSECURE: the etcd password is sent in clear (`allow_plaintext_password`); \
                     use https:// endpoints with [center.tls] outside development"
                );
            }
            crate::center::etcd::start(
                crate::center::etcd::EtcdCenterOptions {
                    endpoints: etcd.endpoints.clone(),
                    prefix: etcd.prefix.clone(),
                    user: etcd
                        .auth
                        .as_ref()
                        .map(|auth| (auth.user.clone(), auth.password.clone())),
                    tls: etcd
                        .tls
                        .as_ref()
                        .map(crate::center::etcd::EtcdTlsFiles::read)
                        .transpose()?,
                },
                tasks,
                stop,
            )
        }
    };
    tracing::info!(center = started.description(), "config center");
    Ok(started)
}

/// Opens every link: its connection info, the topics the relay writes to
/// through it, a producer.
pub(super) async fn open(
    config: &RelayConfig,
    center: Option<&ConfigCenter>,
) -> anyhow::Result<BTreeMap<String, Arc<KafkaLink>>> {
    let mut links = BTreeMap::new();
    for (id, link_config) in &config.links {
        let (info, source) = match (center, &config.center, link_config.from_center) {
            (Some(center), Some(center_config), true) => (
                info_from_center(
                    center,
                    id,
                    link_config,
                    &center_policy(center_config),
                    center_config.wait_for_key(),
                )
                .await?,
                "center",
            ),
            _ => (
                LinkInfo {
                    bootstrap_servers: link_config.bootstrap_servers.clone(),
                    options: link_config.options.clone(),
                },
                "config",
            ),
        };
        if let Err(error) =
            ensure_topics(&info, &owned_topics(config, id), TOPIC_CREATION_TIMEOUT).await
        {
            // Say why the cluster does not answer (TLS, SASL, connection)
            // when librdkafka knows, not only that a request timed out.
            let error = match probe_cluster(&info, PROBE_ON_ERROR_TIMEOUT).await {
                Err(reason) => error.context(format!("{reason:#}")),
                Ok(()) => error,
            };
            return Err(error.context(format!(
                "link `{id}` ({}): preparing the topics the relay writes to",
                info.bootstrap_servers
            )));
        }
        links.insert(
            id.clone(),
            KafkaLink::new(id, info, source).with_context(|| format!("link `{id}`"))?,
        );
    }
    Ok(links)
}

/// Waits (up to `wait`) for `kafka.<id>` in the center and parses it under
/// `policy`; the config file's options are used under the center's.
async fn info_from_center(
    center: &ConfigCenter,
    id: &str,
    link: &LinkConfig,
    policy: &CenterPolicy,
    wait: Duration,
) -> anyhow::Result<LinkInfo> {
    let key = format!("{}{id}", crate::center::KAFKA_KEY_PREFIX);
    let mut state = center.subscribe();
    let deadline = tokio::time::Instant::now() + wait;
    loop {
        let value = state.borrow_and_update().kafka_link(id).map(str::to_string);
        if let Some(value) = value {
            let mut info = LinkInfo::from_center_value(&value, policy).map_err(|problem| {
                anyhow::anyhow!("link `{id}`: bad value at center key `{key}`: {problem}")
            })?;
            for (k, v) in &link.options {
                info.options.entry(k.clone()).or_insert_with(|| v.clone());
            }
            return Ok(info);
        }
        tracing::info!(link = %id, %key, "waiting for the link's key in the config center");
        if tokio::time::timeout_at(deadline, state.changed())
            .await
            .is_err()
        {
            let reachability = match &state.borrow().reachability {
                Reachability::Reachable => String::new(),
                Reachability::Unreachable { error, .. } => {
                    format!("; the center cannot be reached: {error}")
                }
            };
            anyhow::bail!(
                "link `{id}`: the config center ({}) has no key `{key}` (waited {wait:?}){reachability}",
                center.description()
            );
        }
    }
}
