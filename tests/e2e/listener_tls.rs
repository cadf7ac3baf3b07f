//! TLS on the cluster's listeners end to end (issue 10): two real nodes
//! whose client listeners take only mutual TLS with `client_auth = "mtls"`
//! (the client certificate's common name is the process id it may
//! register) and whose mesh is mutual TLS; SDK processes with a client
//! certificate get every message, across the mesh too; the example client
//! without a certificate, with the certificate of another process, or
//! without TLS gets nowhere.

use std::collections::HashSet;
use std::path::Path;
use std::time::Duration;

use support::pki::TestPki;
use support::processes::{ProcessPool, node_config};
use support::relay::RelayProcess;
use support::tansu::{Tansu, TestRecord};
use wasmrelay_client::{ClientConfig, ClientTls};

use wasmrelay_test_support as support;

/// `[cluster]` additions: mTLS clients with certificates of `pki`, and a
/// mutual TLS mesh, both with certificates of `pki`.
fn tls_cluster(pki: &TestPki) -> String {
    let listener = pki.server_cert("client-listener");
    let mesh = pki.node_cert("mesh");
    let ca = pki.ca_path();
    format!(
        "client_auth = \"mtls\"\n\
         [cluster.tls]\ncert = \"{}\"\nkey = \"{}\"\nclient_ca = \"{}\"\n\
         [cluster.mesh_tls]\ncert = \"{}\"\nkey = \"{}\"\nca = \"{}\"\n",
        listener.cert_path.display(),
        listener.key_path.display(),
        ca.display(),
        mesh.cert_path.display(),
        mesh.key_path.display(),
        ca.display(),
    )
}

fn tls_node(id: &str, kafka: &Tansu, pki: &TestPki) -> RelayProcess {
    let base = node_config(id, &kafka.bootstrap(), &tls_cluster(pki));
    let config = base.replace(&support::client_tokens::cluster_keys(), "");
    assert_ne!(config, base, "node_config no longer holds the token keys");
    RelayProcess::start(&config, &[])
}

/// Runs the example client: (success, stderr).
async fn relay_client(addr: &str, process_id: &str, args: &[&str]) -> (bool, String) {
    let run = support::run_relay_client(addr, process_id, args).await;
    (run.ok, run.stderr)
}

fn path(p: &Path) -> String {
    p.display().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_with_mutual_tls_clients_and_mesh_delivers_everything_and_refuses_strangers() {
    let kafka = Tansu::start();
    kafka.create_topic("business", 4).await;
    let pki = TestPki::new("cluster-tls");
    let a = tls_node("node-a", &kafka, &pki);
    let b = tls_node("node-b", &kafka, &pki);
    a.wait_for(
        "both nodes linked over the TLS mesh",
        Duration::from_secs(30),
        || {
            [(&a, "node-b"), (&b, "node-a")].iter().all(|(node, peer)| {
                node.cluster_json()["mesh"]
                    .as_array()
                    .is_some_and(|mesh| mesh.iter().any(|id| id == peer))
            })
        },
    )
    .await;

    // Processes `tls-NN` with one certificate for `tls-*`, half on each
    // node.
    let processes_cert = pki.client_cert("tls-*", "processes");
    let tls = ClientTls::with_ca_file(pki.ca_path())
        .unwrap()
        .with_client_cert_files(&processes_cert.cert_path, &processes_cert.key_path)
        .unwrap();
    let addrs = [a.client_addr().unwrap(), b.client_addr().unwrap()];
    let processes: Vec<String> = (0..10).map(|n| format!("tls-{n:02}")).collect();
    let mut pool = ProcessPool::default();
    for (i, id) in processes.iter().enumerate() {
        let config =
            ClientConfig::new(vec![addrs[i % 2].clone()], id.as_str()).with_tls(tls.clone());
        pool.connect_with(config, true).await;
    }
    a.wait_for(
        "every route known on both nodes",
        Duration::from_secs(30),
        || {
            [&a, &b]
                .iter()
                .all(|node| node.cluster_json()["routes"] == processes.len())
        },
    )
    .await;

    let total = 200;
    let records: Vec<TestRecord> = (0..total)
        .map(|n| {
            let process = &processes[n % processes.len()];
            TestRecord::keyed(process.clone(), n.to_string()).header("process-id", process.clone())
        })
        .collect();
    kafka.produce("business", records).await;
    a.wait_for("every message delivered", Duration::from_secs(60), || {
        pool.count() >= total
    })
    .await;
    let received = pool.received();
    let values: HashSet<Vec<u8>> = received.iter().map(|r| r.value.clone()).collect();
    assert_eq!(values.len(), total, "a message missing");
    for r in &received {
        let n: usize = String::from_utf8_lossy(&r.value).parse().unwrap();
        assert_eq!(r.process_id, processes[n % processes.len()], "misrouted");
    }
    // Some crossed the mesh (processes sit on both nodes, both consume).
    let forwarded: u64 = [&a, &b]
        .iter()
        .map(|node| {
            node.cluster_json()["stats"]["forwards_delivered"]
                .as_u64()
                .unwrap()
        })
        .sum();
    assert!(forwarded > 0, "nothing crossed the mesh");
    let replies = kafka
        .consume_all("business.replies", total, Duration::from_secs(60))
        .await;
    assert_eq!(replies.len(), total, "the replies");

    // Strangers: no client certificate, the certificate of another
    // process, and plain TCP.
    let addr = &addrs[0];
    let ca = path(&pki.ca_path());
    let (ok, stderr) = relay_client(addr, "tls-00", &["--ca", &ca, "--count", "1"]).await;
    assert!(!ok, "admitted without a client certificate: {stderr}");
    assert!(stderr.to_lowercase().contains("certificate"), "{stderr}");
    let other = pki.client_cert("billing-1", "billing-1");
    let (cert, key) = (path(&other.cert_path), path(&other.key_path));
    let (ok, stderr) = relay_client(
        addr,
        "tls-00",
        &["--ca", &ca, "--cert", &cert, "--key", &key, "--count", "1"],
    )
    .await;
    assert!(!ok, "admitted with another process's certificate: {stderr}");
    assert!(
        stderr.contains("the client certificate is for process `billing-1`"),
        "{stderr}"
    );
    let (ok, stderr) = relay_client(addr, "tls-00", &["--count", "1"]).await;
    assert!(!ok, "admitted over plain TCP: {stderr}");
    // The example client with its own certificate is admitted.
    let (ok, stderr) = relay_client(
        addr,
        "billing-1",
        &["--ca", &ca, "--cert", &cert, "--key", &key, "--count", "0"],
    )
    .await;
    assert!(ok, "the example client with its certificate: {stderr}");
    // The processes were not disturbed by any of it.
    assert!(
        pool.events()
            .iter()
            .all(|(_, event)| !event.contains("Replaced")),
        "{:?}",
        pool.events()
    );
}
