//! The client over TLS against a fake node behind rustls: the right CA
//! registers and carries frames both ways, another CA fails naming the
//! certificate problem, a node that requires client certificates takes the
//! configured one and refuses a client without, an explicit server name
//! replaces the dialed host, and redirect targets are verified under their
//! own host names.

use bytes::Bytes;
use wasmrelay_client::{Client, ClientError, ClientTls, OutgoingMessage};
use wasmrelay_protocol::Kind;
use wasmrelay_protocol::v1;

use crate::support::pki::TestCa;
use crate::support::{FakeNode, config, deliver, welcome, within};
use crate::{expect_connected, expect_delivery};

/// The only failure of an `Unreachable` error.
fn single_failure(
    result: Result<(Client, wasmrelay_client::Events), ClientError>,
) -> (String, String) {
    match result {
        Err(ClientError::Unreachable { mut failures }) => {
            assert_eq!(failures.len(), 1, "{failures:?}");
            failures.remove(0)
        }
        Err(other) => panic!("expected Unreachable, got {other:?}"),
        Ok(_) => panic!("expected Unreachable, but the client registered"),
    }
}

#[tokio::test]
async fn a_client_trusting_the_nodes_ca_registers_over_tls_and_exchanges_frames() {
    let ca = TestCa::new("relay");
    let node = FakeNode::start_tls(TestCa::server_config(&ca.server_cert(&["127.0.0.1"]))).await;
    let dir = tempfile::tempdir().unwrap();
    let ca_file = dir.path().join("ca.pem");
    std::fs::write(&ca_file, &ca.pem).unwrap();
    let tls = ClientTls::with_ca_file(&ca_file).unwrap();

    let connecting = tokio::spawn(Client::connect(config(&[&node.address]).with_tls(tls)));
    let mut conn = node.register("node-a").await;
    let (client, mut events) = within("connect", connecting).await.unwrap().unwrap();
    expect_connected(&mut events, "node-a").await;
    assert!(conn.peer_certificates.is_empty());

    // Node to client, and the ack back.
    conn.send(deliver(7, "in/3/41", b"over tls")).await;
    let delivery = expect_delivery(&mut events).await;
    assert_eq!(&delivery.message.value[..], b"over tls");
    delivery.ack().unwrap();
    match conn.recv_kind().await {
        Kind::Ack(ack) => assert_eq!(ack.seq, 7),
        other => panic!("expected Ack, got {other:?}"),
    }

    // Client to node, and the node's answer.
    let sending = tokio::spawn({
        let client = client.clone();
        async move { client.send(OutgoingMessage::new("answer")).await }
    });
    let send = match conn.recv_kind().await {
        Kind::Send(send) => send,
        other => panic!("expected Send, got {other:?}"),
    };
    assert_eq!(send.value, Bytes::from_static(b"answer"));
    conn.send(Kind::SendAck(v1::SendAck {
        seq: send.seq,
        ok: true,
        error: String::new(),
    }))
    .await;
    assert_eq!(within("the send", sending).await.unwrap(), Ok(()));

    client.close().await;
    conn.expect_closed().await;
}

#[tokio::test]
async fn a_node_certificate_from_another_ca_fails_the_attempt_naming_the_certificate_problem() {
    let node_ca = TestCa::new("relay");
    let other_ca = TestCa::new("other");
    let node =
        FakeNode::start_tls(TestCa::server_config(&node_ca.server_cert(&["127.0.0.1"]))).await;
    let tls = ClientTls::with_ca_pem(&other_ca.pem).unwrap();

    let connecting = tokio::spawn(Client::connect(config(&[&node.address]).with_tls(tls)));
    // The node's side of the handshake fails too: no Hello can arrive.
    node.accept_failed_handshake().await;
    let (address, reason) = single_failure(within("connect", connecting).await.unwrap());
    assert_eq!(address, node.address);
    assert_eq!(
        reason,
        format!(
            "TLS handshake with {} failed: invalid peer certificate: UnknownIssuer",
            node.address
        )
    );
}

#[tokio::test]
async fn a_node_requiring_client_certificates_takes_the_configured_one_and_refuses_a_client_without()
 {
    let ca = TestCa::new("relay");
    let node = FakeNode::start_tls(ca.mtls_server_config(&ca.server_cert(&["127.0.0.1"]))).await;
    let identity = ca.client_cert("proc-1");
    let dir = tempfile::tempdir().unwrap();
    let (cert_file, key_file) = identity.write(&dir, "proc-1");

    let with_cert = ClientTls::with_ca_pem(&ca.pem)
        .unwrap()
        .with_client_cert_files(&cert_file, &key_file)
        .unwrap();
    let connecting = tokio::spawn(Client::connect(
        config(&[&node.address]).with_tls(with_cert),
    ));
    let conn = node.register("node-a").await;
    let (client, mut events) = within("connect", connecting).await.unwrap().unwrap();
    expect_connected(&mut events, "node-a").await;
    assert_eq!(conn.peer_certificates, vec![identity.der.clone()]);
    client.close().await;

    let without = ClientTls::with_ca_pem(&ca.pem).unwrap();
    let connecting = tokio::spawn(Client::connect(config(&[&node.address]).with_tls(without)));
    let refused = node.accept_failed_handshake().await;
    assert_eq!(refused.to_string(), "peer sent no certificates");
    let (address, reason) = single_failure(within("connect", connecting).await.unwrap());
    assert_eq!(address, node.address);
    assert_eq!(
        reason,
        "the node ended the TLS session before Welcome: received fatal alert: CertificateRequired"
    );

    // A client certificate from another authority is refused as well.
    let stranger = TestCa::new("stranger").client_cert("proc-1");
    let foreign = ClientTls::with_ca_pem(&ca.pem)
        .unwrap()
        .with_client_cert_pem(&stranger.cert_pem, &stranger.key_pem)
        .unwrap();
    let connecting = tokio::spawn(Client::connect(config(&[&node.address]).with_tls(foreign)));
    let refused = node.accept_failed_handshake().await;
    assert_eq!(
        refused.to_string(),
        "invalid peer certificate: UnknownIssuer"
    );
    let (_, reason) = single_failure(within("connect", connecting).await.unwrap());
    assert_eq!(
        reason,
        "the node ended the TLS session before Welcome: received fatal alert: UnknownCA"
    );
}

#[tokio::test]
async fn an_explicit_server_name_is_verified_instead_of_the_dialed_host() {
    let ca = TestCa::new("relay");
    let node =
        FakeNode::start_tls(TestCa::server_config(&ca.server_cert(&["relay.internal"]))).await;

    // Dialed as 127.0.0.1, which the certificate does not name.
    let plain = ClientTls::with_ca_pem(&ca.pem).unwrap();
    let connecting = tokio::spawn(Client::connect(
        config(&[&node.address]).with_tls(plain.clone()),
    ));
    node.accept_failed_handshake().await;
    let (_, reason) = single_failure(within("connect", connecting).await.unwrap());
    assert!(
        reason.starts_with(&format!("TLS handshake with {} failed: ", node.address))
            && reason.contains(r#"certificate not valid for name "127.0.0.1""#),
        "{reason}"
    );

    let named = plain.with_server_name("relay.internal").unwrap();
    let connecting = tokio::spawn(Client::connect(config(&[&node.address]).with_tls(named)));
    let _conn = node.register("node-a").await;
    let (_client, mut events) = within("connect", connecting).await.unwrap().unwrap();
    expect_connected(&mut events, "node-a").await;
}

#[tokio::test]
async fn a_redirect_target_is_dialed_over_tls_and_verified_under_its_own_host_name() {
    let ca = TestCa::new("relay");
    let first = FakeNode::start_tls(TestCa::server_config(&ca.server_cert(&["127.0.0.1"]))).await;
    // Named only `localhost`: reached as 127.0.0.1 it would be refused.
    let second = FakeNode::start_tls(TestCa::server_config(&ca.server_cert(&["localhost"]))).await;
    let port = second.address.rsplit_once(':').unwrap().1;
    let target = format!("localhost:{port}");

    let tls = ClientTls::with_ca_pem(&ca.pem).unwrap();
    let connecting = tokio::spawn(Client::connect(config(&[&first.address]).with_tls(tls)));
    let (mut redirecting, _) = first.accept_hello().await;
    redirecting
        .send(Kind::Redirect(v1::Redirect {
            addresses: vec![target.clone()],
            reason: "owned elsewhere".to_string(),
        }))
        .await;
    let _conn = second.register_with(welcome("node-b", 0)).await;
    let (client, mut events) = within("connect", connecting).await.unwrap().unwrap();
    assert_eq!(client.node_id().as_deref(), Some("node-b"));
    expect_connected(&mut events, "node-b").await;
}
