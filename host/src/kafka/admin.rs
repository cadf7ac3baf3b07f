//! Creating the topics the relay owns (dead-letter, output, heartbeat,
//! routes) when they are missing: some brokers (tansu among them) do not
//! create topics on first use.

use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::error::RDKafkaErrorCode;

use super::link::LinkInfo;

/// How a missing topic is created.
#[derive(Clone, Debug)]
pub struct TopicSpec {
    /// Topic name.
    pub name: String,
    /// Partitions of a new topic.
    pub partitions: i32,
    /// Extra topic configs (e.g. `cleanup.policy=compact`).
    pub configs: Vec<(String, String)>,
}

impl TopicSpec {
    /// A plain topic with `partitions` partitions.
    pub fn new(name: impl Into<String>, partitions: i32) -> Self {
        TopicSpec {
            name: name.into(),
            partitions,
            configs: Vec::new(),
        }
    }
}

/// Creates each topic that does not exist yet and waits until all of them
/// are visible in metadata. Topics that exist are left alone.
pub async fn ensure_topics(
    link: &LinkInfo,
    topics: &[TopicSpec],
    timeout: Duration,
) -> anyhow::Result<()> {
    if topics.is_empty() {
        return Ok(());
    }
    let admin: AdminClient<DefaultClientContext> = link
        .admin_config()
        .create()
        .context("creating a Kafka admin client")?;
    let new_topics: Vec<NewTopic<'_>> = topics
        .iter()
        .map(|spec| {
            spec.configs.iter().fold(
                NewTopic::new(&spec.name, spec.partitions, TopicReplication::Fixed(-1)),
                |topic, (k, v)| topic.set(k, v),
            )
        })
        .collect();
    let options = AdminOptions::new().operation_timeout(Some(timeout));
    let results = admin
        .create_topics(new_topics.iter(), &options)
        .await
        .with_context(|| format!("creating topics on {}", link.bootstrap_servers))?;
    for result in results {
        match result {
            Ok(_) | Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
            Err((topic, code)) => bail!(
                "creating topic `{topic}` on {}: {code}",
                link.bootstrap_servers
            ),
        }
    }
    // Creation is asynchronous on the broker side: wait until metadata shows them.
    let deadline = Instant::now() + timeout;
    let names: Vec<String> = topics.iter().map(|t| t.name.clone()).collect();
    let metadata_admin = admin;
    loop {
        let missing = {
            let client = metadata_admin.inner();
            let names = names.clone();
            let metadata =
                tokio::task::block_in_place(|| client.fetch_metadata(None, Duration::from_secs(5)))
                    .with_context(|| format!("reading metadata from {}", link.bootstrap_servers))?;
            names
                .into_iter()
                .filter(|name| {
                    !metadata.topics().iter().any(|t| {
                        t.name() == name && !t.partitions().is_empty() && t.error().is_none()
                    })
                })
                .collect::<Vec<_>>()
        };
        if missing.is_empty() {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!(
                "topics {missing:?} did not appear on {} within {timeout:?}",
                link.bootstrap_servers
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
