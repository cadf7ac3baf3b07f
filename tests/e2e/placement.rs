//! Placement of new processes end to end (issue 11): real nodes with
//! different connection quotas, SDK processes that all know only one
//! node's address, redirected to the node with the lowest share of its
//! quota in use; no node above its quota; a cluster that is full refuses
//! with the reason; a router plugin's `place` pins processes to a node.

use std::collections::HashMap;
use std::time::Duration;

use support::processes::{ProcessPool, node_config};
use support::relay::RelayProcess;
use support::tansu::Tansu;
use wasmrelay_client::{Client, ClientConfig};

use wasmrelay_test_support as support;

/// Nodes `node-1`, `node-2`, ... with the given quotas (and `extra` in
/// `[cluster]`), once each sees all of them live.
async fn start_nodes(kafka: &Tansu, quotas: &[u64], extra: &str) -> Vec<RelayProcess> {
    let nodes: Vec<RelayProcess> = quotas
        .iter()
        .enumerate()
        .map(|(i, quota)| {
            let config = node_config(
                &format!("node-{}", i + 1),
                &kafka.bootstrap(),
                &format!("connection_quota = {quota}\n{extra}"),
            );
            RelayProcess::start(&config, &[])
        })
        .collect();
    RelayProcess::wait_all_live(&nodes, quotas.len(), Duration::from_secs(30)).await;
    nodes
}

fn sdk_config(address: &str, process_id: &str) -> ClientConfig {
    ClientConfig::new(vec![address.to_string()], process_id)
        .with_token(support::client_tokens::token(process_id))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn processes_given_one_address_spread_over_the_nodes_by_quota() {
    let kafka = Tansu::start();
    kafka.create_topic("business", 1).await;
    let quotas = [1000, 1000, 500];
    let nodes = start_nodes(&kafka, &quotas, "").await;
    let first = nodes[0].client_addr().unwrap();

    let total = 2000;
    let mut pool = ProcessPool::default();
    for n in 0..total {
        pool.connect(std::slice::from_ref(&first), &format!("p-{n:04}"), false)
            .await;
    }
    nodes[0]
        .wait_for("every process counted", Duration::from_secs(30), || {
            RelayProcess::connections_by_node(&nodes)
                .values()
                .sum::<u64>()
                == total
        })
        .await;
    let counts = RelayProcess::connections_by_node(&nodes);
    let quota_sum: u64 = quotas.iter().sum();
    for (i, quota) in quotas.iter().enumerate() {
        let count = counts[&format!("node-{}", i + 1)];
        assert!(
            count <= *quota,
            "node-{} above its quota: {counts:?}",
            i + 1
        );
        let share = total * quota / quota_sum;
        assert!(
            count.abs_diff(share) * 10 <= share,
            "node-{} holds {count}, not within 10% of its share {share}: {counts:?}",
            i + 1
        );
    }
    // Each process is where its SDK says.
    let by_node = pool
        .settled_nodes(Duration::from_secs(10))
        .await
        .into_values()
        .fold(HashMap::new(), |mut m, node| {
            *m.entry(node).or_insert(0u64) += 1;
            m
        });
    assert_eq!(by_node, counts, "the SDK's nodes and /cluster disagree");
    let redirected: u64 = nodes
        .iter()
        .map(|node| {
            node.cluster_json()["stats"]["clients_redirected"]
                .as_u64()
                .unwrap()
        })
        .sum();
    assert!(
        redirected >= counts["node-2"] + counts["node-3"],
        "{redirected} redirects for {counts:?}"
    );
    // The same counts in the Prometheus metrics.
    let in_metrics: u64 = nodes
        .iter()
        .map(|node| node.metric("wasmrelay_cluster_clients_redirected_total"))
        .sum();
    assert_eq!(in_metrics, redirected);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_cluster_refuses_a_new_process_with_the_reason() {
    let kafka = Tansu::start();
    kafka.create_topic("business", 1).await;
    let nodes = start_nodes(&kafka, &[3, 3, 2], "").await;
    let first = nodes[0].client_addr().unwrap();
    let mut pool = ProcessPool::default();
    for n in 0..8 {
        pool.connect(std::slice::from_ref(&first), &format!("p-{n}"), false)
            .await;
    }
    let counts = RelayProcess::connections_by_node(&nodes);
    assert_eq!(
        counts,
        HashMap::from([
            ("node-1".to_string(), 3),
            ("node-2".to_string(), 3),
            ("node-3".to_string(), 2)
        ])
    );
    let Err(error) = Client::connect(sdk_config(&first, "p-8")).await else {
        panic!("a ninth process got in");
    };
    let text = error.to_string();
    assert!(
        text.contains("NODE_FULL") && text.contains("connection quota"),
        "{text}"
    );
    let refused: u64 = nodes
        .iter()
        .map(|node| {
            node.cluster_json()["stats"]["clients_refused_full"]
                .as_u64()
                .unwrap()
        })
        .sum();
    assert!(refused >= 1);
    let in_metrics: u64 = nodes
        .iter()
        .map(|node| node.metric("wasmrelay_cluster_clients_refused_full_total"))
        .sum();
    assert_eq!(in_metrics, refused);
    // A process that is connected already may still come back.
    let (again, _events) = Client::connect(sdk_config(&first, "p-0"))
        .await
        .expect("p-0 could not take its own place back");
    drop(again);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_router_plugins_place_pins_processes_to_a_node() {
    let kafka = Tansu::start();
    kafka.create_topic("business", 1).await;
    let pin = "[plugins.config.route-by-field]\npin_prefix = \"a-\"\npin_node = \"node-1\"\n";
    let nodes: Vec<RelayProcess> = (1..=3)
        .map(|i| {
            let config = node_config(&format!("node-{i}"), &kafka.bootstrap(), "")
                .replace(
                    "[flows.deliver.cluster]",
                    "[flows.deliver.cluster]\nrouter = \"route-by-field\"",
                )
                .replace("[links.main]", &format!("{pin}[links.main]"));
            RelayProcess::start(&config, &[])
        })
        .collect();
    RelayProcess::wait_all_live(&nodes, 3, Duration::from_secs(30)).await;
    // Everyone connects to node-3 first.
    let third = nodes[2].client_addr().unwrap();
    let mut pool = ProcessPool::default();
    for n in 0..10 {
        pool.connect(std::slice::from_ref(&third), &format!("a-{n}"), false)
            .await;
        pool.connect(std::slice::from_ref(&third), &format!("b-{n}"), false)
            .await;
    }
    let placed = pool.settled_nodes(Duration::from_secs(10)).await;
    for n in 0..10 {
        assert_eq!(placed[&format!("a-{n}")], "node-1", "{placed:?}");
    }
    // The others go by the built-in rule: not all on node-1.
    let b_elsewhere = (0..10)
        .filter(|n| placed[&format!("b-{n}")] != "node-1")
        .count();
    assert!(b_elsewhere >= 5, "{placed:?}");
}
