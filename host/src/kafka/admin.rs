//! Creating the topics the relay owns (dead-letter, output, heartbeat,
//! routes) when they are missing: some brokers (tansu among them) do not
//! create topics on first use. Topics that exist are left alone, so a
//! cluster whose ACLs forbid creating topics works as long as they exist.

use std::sync::Arc;
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

type Admin = Arc<AdminClient<DefaultClientContext>>;

/// The topics among `names` that the cluster's metadata does not show (with
/// at least one partition).
async fn missing_topics(
    admin: &Admin,
    names: &[String],
    link: &LinkInfo,
) -> anyhow::Result<Vec<String>> {
    let client = admin.clone();
    let metadata = tokio::task::spawn_blocking(move || {
        client.inner().fetch_metadata(None, Duration::from_secs(10))
    })
    .await
    .context("metadata task")?
    .with_context(|| format!("reading metadata from {}", link.bootstrap_servers))?;
    Ok(names
        .iter()
        .filter(|name| {
            !metadata.topics().iter().any(|t| {
                t.name() == name.as_str() && !t.partitions().is_empty() && t.error().is_none()
            })
        })
        .cloned()
        .collect())
}

/// Creates each topic that does not exist yet and waits until all of them
/// are visible in metadata.
pub async fn ensure_topics(
    link: &LinkInfo,
    topics: &[TopicSpec],
    timeout: Duration,
) -> anyhow::Result<()> {
    if topics.is_empty() {
        return Ok(());
    }
    let admin: Admin = Arc::new(
        link.create(&link.admin_config())
            .context("creating a Kafka admin client")?,
    );
    let names: Vec<String> = topics.iter().map(|t| t.name.clone()).collect();
    let missing = missing_topics(&admin, &names, link).await?;
    if missing.is_empty() {
        return Ok(());
    }
    let new_topics: Vec<NewTopic<'_>> = topics
        .iter()
        .filter(|spec| missing.contains(&spec.name))
        .map(|spec| {
            spec.configs.iter().fold(
                NewTopic::new(&spec.name, spec.partitions, TopicReplication::Fixed(-1)),
                |topic, (k, v)| topic.set(k, v),
            )
        })
        .collect();
    tracing::info!(topics = ?missing, "creating missing topics");
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
    // Creation completes asynchronously on the broker: wait for metadata.
    let deadline = Instant::now() + timeout;
    loop {
        let still_missing = missing_topics(&admin, &missing, link).await?;
        if still_missing.is_empty() {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!(
                "topics {still_missing:?} did not appear on {} within {timeout:?}",
                link.bootstrap_servers
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
