//! The client against a fake relay node: registration, deliveries and
//! acks, sends, redirects, reconnection, replacement, refusals, keepalive,
//! tokens (sent in every Hello, re-read for every attempt; a refused token
//! is a permanent error), and TLS (`tls`).

// Tasks a test spawns end with the test's runtime; the test awaits
// those whose outcome it checks.
#![allow(clippy::unwrap_used, clippy::disallowed_methods)]

mod support;
mod tls;

use std::time::Duration;

use bytes::Bytes;
use support::{FakeNode, config, deliver, error, next_event, welcome, within};
use wasmrelay_client::{
    AckError, Client, ClientError, ErrorCode, Event, OutgoingMessage, SendError,
};
use wasmrelay_protocol::v1;
use wasmrelay_protocol::{Kind, PROTOCOL_VERSION};

async fn expect_connected(events: &mut wasmrelay_client::Events, node: &str) {
    match next_event(events).await {
        Event::Connected { node_id } => assert_eq!(node_id, node),
        other => panic!("expected Connected to {node}, got {other:?}"),
    }
}

async fn expect_delivery(events: &mut wasmrelay_client::Events) -> wasmrelay_client::Delivery {
    match next_event(events).await {
        Event::Delivery(delivery) => delivery,
        other => panic!("expected a delivery, got {other:?}"),
    }
}

async fn expect_disconnected(events: &mut wasmrelay_client::Events) -> String {
    match next_event(events).await {
        Event::Disconnected { reason } => reason,
        other => panic!("expected Disconnected, got {other:?}"),
    }
}

#[tokio::test]
async fn connects_and_registers() {
    let node = FakeNode::start().await;
    let connecting = tokio::spawn(Client::connect(config(&[&node.address])));
    let (mut conn, hello) = node.accept_hello().await;
    assert_eq!(hello.protocol_version, PROTOCOL_VERSION);
    assert_eq!(hello.process_id, "proc-1");
    assert!(hello.accepts_redirect);
    assert!(hello.client_name.starts_with("wasmrelay-client/"));
    conn.send(Kind::Welcome(welcome("node-a", 0))).await;

    let (client, mut events) = within("connect", connecting).await.unwrap().unwrap();
    assert_eq!(client.node_id().as_deref(), Some("node-a"));
    expect_connected(&mut events, "node-a").await;

    client.close().await;
    conn.expect_closed().await;
    assert!(
        within("the end of the events", events.next())
            .await
            .is_none()
    );
}

#[tokio::test]
async fn deliveries_are_acked_and_nacked_by_their_seq() {
    let node = FakeNode::start().await;
    let connecting = tokio::spawn(Client::connect(config(&[&node.address])));
    let mut conn = node.register("node-a").await;
    let (_client, mut events) = within("connect", connecting).await.unwrap().unwrap();
    expect_connected(&mut events, "node-a").await;

    conn.send(deliver(7, "in/3/41", b"first")).await;
    conn.send(deliver(8, "in/3/42", b"second")).await;
    let first = expect_delivery(&mut events).await;
    let second = expect_delivery(&mut events).await;
    assert_eq!(first.delivery_id, "in/3/41");
    assert_eq!(first.seq(), 7);
    assert_eq!(first.node_id(), "node-a");
    assert_eq!(first.message.key.as_deref(), Some(&b"k"[..]));
    assert_eq!(&first.message.value[..], b"first");
    assert_eq!(
        first.message.headers,
        vec![("h".to_string(), Bytes::from_static(b"hv"))]
    );
    assert_eq!(first.message.topic, "in");
    assert_eq!((first.message.partition, first.message.offset), (3, 41));
    assert_eq!(first.message.timestamp_ms, 1_700_000_000_000);
    assert_eq!(&second.message.value[..], b"second");

    // Dropped unsettled: nothing is sent for it.
    conn.send(deliver(9, "in/3/43", b"third")).await;
    drop(expect_delivery(&mut events).await);

    // Settled out of order: each names its own seq.
    second.nack("cannot parse").unwrap();
    first.ack().unwrap();
    match conn.recv_kind().await {
        Kind::Nack(nack) => {
            assert_eq!(nack.seq, 8);
            assert_eq!(nack.reason, "cannot parse");
        }
        other => panic!("expected Nack, got {other:?}"),
    }
    match conn.recv_kind().await {
        Kind::Ack(ack) => assert_eq!(ack.seq, 7),
        other => panic!("expected Ack, got {other:?}"),
    }
}

#[tokio::test]
async fn sends_complete_with_their_own_send_ack() {
    let node = FakeNode::start().await;
    let connecting = tokio::spawn(Client::connect(config(&[&node.address])));
    let mut conn = node.register("node-a").await;
    let (client, _events) = within("connect", connecting).await.unwrap().unwrap();

    let accepted = tokio::spawn({
        let client = client.clone();
        async move {
            let message = OutgoingMessage::new("answer")
                .with_key("k1")
                .with_header("h", "1")
                .with_in_reply_to("in/3/41");
            client.send(message).await
        }
    });
    let first = match conn.recv_kind().await {
        Kind::Send(send) => send,
        other => panic!("expected Send, got {other:?}"),
    };
    assert_eq!(first.key.as_deref(), Some(&b"k1"[..]));
    assert_eq!(&first.value[..], b"answer");
    assert_eq!(first.headers.len(), 1);
    assert_eq!(first.headers[0].name, "h");
    assert_eq!(first.in_reply_to, "in/3/41");

    let refused = tokio::spawn({
        let client = client.clone();
        async move { client.send(OutgoingMessage::new("other")).await }
    });
    let second = match conn.recv_kind().await {
        Kind::Send(send) => send,
        other => panic!("expected Send, got {other:?}"),
    };
    assert_ne!(first.seq, second.seq);
    assert_eq!(second.in_reply_to, "");

    // Answered in the other order: each send gets its own answer.
    conn.send(Kind::SendAck(v1::SendAck {
        seq: second.seq,
        ok: false,
        error: "topic is read-only".to_string(),
    }))
    .await;
    assert_eq!(
        within("the refused send", refused).await.unwrap(),
        Err(SendError::Rejected("topic is read-only".to_string()))
    );
    assert!(!accepted.is_finished());
    conn.send(Kind::SendAck(v1::SendAck {
        seq: first.seq,
        ok: true,
        error: String::new(),
    }))
    .await;
    assert_eq!(within("the accepted send", accepted).await.unwrap(), Ok(()));
}

#[tokio::test]
async fn sends_larger_than_the_node_accepts_are_refused_locally() {
    let node = FakeNode::start().await;
    let connecting = tokio::spawn(Client::connect(config(&[&node.address])));
    let mut small = welcome("node-a", 0);
    small.max_frame_bytes = 2048;
    let _conn = node.register_with(small).await;
    let (client, _events) = within("connect", connecting).await.unwrap().unwrap();
    let result = within(
        "the send",
        client.send(OutgoingMessage::new(vec![b'x'; 4096])),
    )
    .await;
    assert!(
        matches!(result, Err(SendError::TooLarge { max: 2048, .. })),
        "{result:?}"
    );
}

#[tokio::test]
async fn redirects_are_followed() {
    let first = FakeNode::start().await;
    let second = FakeNode::start().await;
    let connecting = tokio::spawn(Client::connect(config(&[&first.address])));
    let (mut redirecting, _) = first.accept_hello().await;
    redirecting
        .send(Kind::Redirect(v1::Redirect {
            addresses: vec![second.address.clone()],
            reason: "least loaded".to_string(),
        }))
        .await;
    let _conn = second.register("node-b").await;
    let (client, mut events) = within("connect", connecting).await.unwrap().unwrap();
    assert_eq!(client.node_id().as_deref(), Some("node-b"));
    expect_connected(&mut events, "node-b").await;
    redirecting.expect_closed().await;
}

#[tokio::test]
async fn reconnects_after_the_node_drops_the_connection() {
    let node = FakeNode::start().await;
    let connecting = tokio::spawn(Client::connect(config(&[&node.address])));
    let mut conn = node.register("node-a").await;
    let (client, mut events) = within("connect", connecting).await.unwrap().unwrap();
    expect_connected(&mut events, "node-a").await;

    conn.send(deliver(1, "in/3/41", b"v")).await;
    let old_delivery = expect_delivery(&mut events).await;
    let in_flight = tokio::spawn({
        let client = client.clone();
        async move { client.send(OutgoingMessage::new("unanswered")).await }
    });
    assert!(matches!(conn.recv_kind().await, Kind::Send(_)));

    drop(conn);
    expect_disconnected(&mut events).await;
    assert_eq!(
        within("the in-flight send", in_flight).await.unwrap(),
        Err(SendError::ConnectionLost)
    );

    // A send while disconnected waits for the next connection.
    let waiting = tokio::spawn({
        let client = client.clone();
        async move { client.send(OutgoingMessage::new("later")).await }
    });
    let mut conn = node.register("node-a2").await;
    expect_connected(&mut events, "node-a2").await;
    assert_eq!(client.node_id().as_deref(), Some("node-a2"));
    assert_eq!(old_delivery.ack(), Err(AckError::ConnectionGone));

    let send = match conn.recv_kind().await {
        Kind::Send(send) => send,
        other => panic!("expected Send, got {other:?}"),
    };
    assert_eq!(&send.value[..], b"later");
    conn.send(Kind::SendAck(v1::SendAck {
        seq: send.seq,
        ok: true,
        error: String::new(),
    }))
    .await;
    assert_eq!(within("the waiting send", waiting).await.unwrap(), Ok(()));

    // Deliveries of the new connection are acked on it.
    conn.send(deliver(1, "in/3/41", b"v")).await;
    expect_delivery(&mut events).await.ack().unwrap();
    assert!(matches!(
        conn.recv_kind().await,
        Kind::Ack(v1::Ack { seq: 1 })
    ));
}

#[tokio::test]
async fn an_error_from_the_node_disconnects_and_reconnects() {
    let node = FakeNode::start().await;
    let connecting = tokio::spawn(Client::connect(config(&[&node.address])));
    let mut conn = node.register("node-a").await;
    let (_client, mut events) = within("connect", connecting).await.unwrap().unwrap();
    expect_connected(&mut events, "node-a").await;

    conn.send(error(ErrorCode::SlowConsumer, "too slow")).await;
    let reason = expect_disconnected(&mut events).await;
    assert!(reason.contains("ERROR_CODE_SLOW_CONSUMER"), "{reason}");
    assert!(reason.contains("too slow"), "{reason}");
    conn.expect_closed().await;
    let _conn = node.register("node-a").await;
    expect_connected(&mut events, "node-a").await;
}

#[tokio::test]
async fn rebalance_moves_the_connection_to_the_given_node() {
    let first = FakeNode::start().await;
    let second = FakeNode::start().await;
    let connecting = tokio::spawn(Client::connect(config(&[&first.address])));
    let mut conn = first.register("node-a").await;
    let (client, mut events) = within("connect", connecting).await.unwrap().unwrap();
    expect_connected(&mut events, "node-a").await;
    conn.send(deliver(1, "in/3/41", b"v")).await;
    let old_delivery = expect_delivery(&mut events).await;

    conn.send(Kind::Rebalance(v1::Rebalance {
        addresses: vec![second.address.clone()],
        reason: "balancing".to_string(),
    }))
    .await;
    let reason = expect_disconnected(&mut events).await;
    assert!(reason.contains("balancing"), "{reason}");
    let _conn = second.register("node-b").await;
    expect_connected(&mut events, "node-b").await;
    assert_eq!(client.node_id().as_deref(), Some("node-b"));
    assert_eq!(old_delivery.ack(), Err(AckError::ConnectionGone));
    conn.expect_closed().await;
}

#[tokio::test]
async fn replaced_ends_the_events_and_stops_reconnecting() {
    let node = FakeNode::start().await;
    let connecting = tokio::spawn(Client::connect(config(&[&node.address])));
    let mut conn = node.register("node-a").await;
    let (client, mut events) = within("connect", connecting).await.unwrap().unwrap();
    expect_connected(&mut events, "node-a").await;

    conn.send(Kind::Replaced(v1::Replaced {
        reason: "registered again on node-b".to_string(),
    }))
    .await;
    match next_event(&mut events).await {
        Event::Replaced { reason } => assert_eq!(reason, "registered again on node-b"),
        other => panic!("expected Replaced, got {other:?}"),
    }
    assert!(
        within("the end of the events", events.next())
            .await
            .is_none()
    );
    assert_eq!(client.node_id(), None);
    let result = within(
        "a send after Replaced",
        client.send(OutgoingMessage::new("x")),
    )
    .await;
    assert!(matches!(result, Err(SendError::Stopped(_))), "{result:?}");
    conn.expect_closed().await;
    // With a 10 ms backoff, a reconnecting client would be back by now.
    node.assert_no_connection(Duration::from_millis(300)).await;
}

#[tokio::test]
async fn unsupported_version_is_returned_without_retrying() {
    let first = FakeNode::start().await;
    let second = FakeNode::start().await;
    let connecting = tokio::spawn(Client::connect(config(&[&first.address, &second.address])));
    let (mut conn, _) = first.accept_hello().await;
    conn.send(error(ErrorCode::UnsupportedVersion, "speak version 2"))
        .await;
    let result = within("connect", connecting).await.unwrap();
    match result {
        Err(ClientError::Refused {
            address,
            code,
            message,
        }) => {
            assert_eq!(address, first.address);
            assert_eq!(code, ErrorCode::UnsupportedVersion);
            assert_eq!(message, "speak version 2");
        }
        other => panic!("expected Refused, got {other:?}"),
    }
    // `connect` has returned and left no task behind: any other attempt
    // would already be in the backlog.
    second
        .assert_no_connection(Duration::from_millis(100))
        .await;
    first.assert_no_connection(Duration::from_millis(100)).await;
}

#[tokio::test]
async fn a_retryable_error_moves_on_to_the_next_address() {
    let first = FakeNode::start().await;
    let second = FakeNode::start().await;
    let connecting = tokio::spawn(Client::connect(config(&[&first.address, &second.address])));
    let (mut conn, _) = first.accept_hello().await;
    conn.send(error(ErrorCode::ShuttingDown, "bye")).await;
    let _conn = second.register("node-b").await;
    let (client, _events) = within("connect", connecting).await.unwrap().unwrap();
    assert_eq!(client.node_id().as_deref(), Some("node-b"));
}

#[tokio::test]
async fn no_reachable_address_is_an_error() {
    let address = {
        let node = FakeNode::start().await;
        node.address.clone()
    };
    let result = within("connect", Client::connect(config(&[&address]))).await;
    match result {
        Err(ClientError::Unreachable { failures }) => {
            assert_eq!(failures.len(), 1);
            assert_eq!(failures[0].0, address);
        }
        other => panic!("expected Unreachable, got {other:?}"),
    }
}

#[tokio::test]
async fn keepalive_pings_are_sent_and_pings_are_answered() {
    let node = FakeNode::start().await;
    let connecting = tokio::spawn(Client::connect(config(&[&node.address])));
    let mut conn = node.register_with(welcome("node-a", 200)).await;
    let (_client, mut events) = within("connect", connecting).await.unwrap().unwrap();
    expect_connected(&mut events, "node-a").await;

    conn.send(Kind::Ping(v1::Ping { nonce: 42 })).await;
    let mut pong = None;
    let mut ping_nonces = Vec::new();
    within("a Pong and two Pings", async {
        while pong.is_none() || ping_nonces.len() < 2 {
            match conn.recv_kind().await {
                Kind::Pong(p) => pong = Some(p.nonce),
                Kind::Ping(ping) => {
                    ping_nonces.push(ping.nonce);
                    conn.send(Kind::Pong(v1::Pong { nonce: ping.nonce })).await;
                }
                other => panic!("expected Ping or Pong, got {other:?}"),
            }
        }
    })
    .await;
    assert_eq!(pong, Some(42));
    assert_ne!(ping_nonces[0], ping_nonces[1]);
}

#[tokio::test]
async fn a_silent_node_is_given_up_on() {
    let node = FakeNode::start().await;
    let connecting = tokio::spawn(Client::connect(config(&[&node.address])));
    // Keepalive 100 ms: the client pings, the node never answers.
    let _silent = node.register_with(welcome("node-a", 100)).await;
    let (_client, mut events) = within("connect", connecting).await.unwrap().unwrap();
    expect_connected(&mut events, "node-a").await;
    let reason = expect_disconnected(&mut events).await;
    assert!(reason.contains("nothing heard"), "{reason}");
    let _conn = node.register("node-a").await;
    expect_connected(&mut events, "node-a").await;
}

#[tokio::test]
async fn a_permanent_refusal_while_reconnecting_stops_the_client() {
    let node = FakeNode::start().await;
    let connecting = tokio::spawn(Client::connect(config(&[&node.address])));
    let conn = node.register("node-a").await;
    let (client, mut events) = within("connect", connecting).await.unwrap().unwrap();
    expect_connected(&mut events, "node-a").await;
    drop(conn);
    expect_disconnected(&mut events).await;
    let (mut conn, _) = node.accept_hello().await;
    conn.send(error(ErrorCode::BadProcessId, "not allowed here"))
        .await;
    match next_event(&mut events).await {
        Event::Refused { reason } => {
            assert!(reason.contains("ERROR_CODE_BAD_PROCESS_ID"), "{reason}");
        }
        other => panic!("expected Refused, got {other:?}"),
    }
    assert!(
        within("the end of the events", events.next())
            .await
            .is_none()
    );
    let result = within(
        "a send after Refused",
        client.send(OutgoingMessage::new("x")),
    )
    .await;
    assert!(matches!(result, Err(SendError::Stopped(_))), "{result:?}");
}

#[tokio::test]
async fn the_token_is_sent_in_the_hello_and_a_refused_one_is_returned_without_retrying() {
    let first = FakeNode::start().await;
    let second = FakeNode::start().await;
    let config = config(&[&first.address, &second.address]).with_token("header.claims.sig");
    let connecting = tokio::spawn(Client::connect(config));
    let (mut conn, hello) = first.accept_hello().await;
    assert_eq!(hello.token, "header.claims.sig");
    conn.send(error(ErrorCode::Unauthorized, "the token has expired"))
        .await;
    match within("connect", connecting).await.unwrap() {
        Err(error @ ClientError::Refused { .. }) => {
            let text = error.to_string();
            assert!(
                text.contains("ERROR_CODE_UNAUTHORIZED") && text.contains("the token has expired"),
                "{text}"
            );
            assert!(!text.contains("header.claims.sig"), "{text}");
        }
        other => panic!("expected Refused, got {other:?}"),
    }
    // No other node is tried with a token every node refuses.
    second
        .assert_no_connection(Duration::from_millis(100))
        .await;
}

#[tokio::test]
async fn a_token_file_is_read_again_for_every_connection_and_a_refusal_stops_the_client() {
    let dir = std::env::temp_dir().join(format!("wasmrelay-client-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("token");
    std::fs::write(&path, "first.token.sig\n").unwrap();
    let node = FakeNode::start().await;
    let connecting = tokio::spawn(Client::connect(
        config(&[&node.address]).with_token_file(&path),
    ));
    let (mut conn, hello) = node.accept_hello().await;
    assert_eq!(hello.token, "first.token.sig");
    conn.send(Kind::Welcome(welcome("node-a", 0))).await;
    let (client, mut events) = within("connect", connecting).await.unwrap().unwrap();
    expect_connected(&mut events, "node-a").await;

    // The token is refreshed in place; the next connection sends the new one.
    std::fs::write(&path, "second.token.sig").unwrap();
    drop(conn);
    expect_disconnected(&mut events).await;
    let (conn, hello) = node.accept_hello().await;
    assert_eq!(hello.token, "second.token.sig");
    drop(conn);

    // Refused while reconnecting: the client stops with the reason.
    let (mut conn, _) = node.accept_hello().await;
    conn.send(error(
        ErrorCode::Unauthorized,
        "the token is for process `other`, not `proc-1`",
    ))
    .await;
    loop {
        match next_event(&mut events).await {
            Event::Disconnected { .. } => continue,
            Event::Refused { reason } => {
                assert!(reason.contains("ERROR_CODE_UNAUTHORIZED"), "{reason}");
                assert!(reason.contains("not `proc-1`"), "{reason}");
                break;
            }
            other => panic!("expected Refused, got {other:?}"),
        }
    }
    assert!(
        within("the end of the events", events.next())
            .await
            .is_none()
    );
    node.assert_no_connection(Duration::from_millis(200)).await;
    let result = within(
        "a send after Refused",
        client.send(OutgoingMessage::new("x")),
    )
    .await;
    assert!(matches!(result, Err(SendError::Stopped(_))), "{result:?}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[tokio::test]
async fn a_missing_token_file_fails_connect_without_dialing() {
    let node = FakeNode::start().await;
    let config = config(&[&node.address]).with_token_file("/nonexistent/wasmrelay/token");
    match within("connect", Client::connect(config)).await {
        Err(ClientError::Token(reason)) => {
            assert!(reason.contains("/nonexistent/wasmrelay/token"), "{reason}");
        }
        other => panic!("expected a token error, got {other:?}"),
    }
    node.assert_no_connection(Duration::from_millis(100)).await;
}

#[tokio::test]
async fn close_flushes_acks_and_stops() {
    let node = FakeNode::start().await;
    let connecting = tokio::spawn(Client::connect(config(&[&node.address])));
    let mut conn = node.register("node-a").await;
    let (client, mut events) = within("connect", connecting).await.unwrap().unwrap();
    expect_connected(&mut events, "node-a").await;
    conn.send(deliver(5, "in/3/41", b"v")).await;
    let delivery = expect_delivery(&mut events).await;
    delivery.ack().unwrap();
    within("close", client.clone().close()).await;
    assert!(matches!(
        conn.recv_kind().await,
        Kind::Ack(v1::Ack { seq: 5 })
    ));
    conn.expect_closed().await;
    assert!(
        within("the end of the events", events.next())
            .await
            .is_none()
    );
    let result = within("a send after close", client.send(OutgoingMessage::new("x"))).await;
    assert!(matches!(result, Err(SendError::Stopped(_))), "{result:?}");
    node.assert_no_connection(Duration::from_millis(200)).await;
}

#[tokio::test]
async fn dropping_every_handle_and_the_events_closes_the_connection() {
    let node = FakeNode::start().await;
    let connecting = tokio::spawn(Client::connect(config(&[&node.address])));
    let mut conn = node.register("node-a").await;
    let (client, events) = within("connect", connecting).await.unwrap().unwrap();
    let other_handle = client.clone();
    drop(client);
    drop(events);
    // One handle left: the connection stays.
    conn.send(Kind::Ping(v1::Ping { nonce: 1 })).await;
    assert!(matches!(
        conn.recv_kind().await,
        Kind::Pong(v1::Pong { nonce: 1 })
    ));
    drop(other_handle);
    conn.expect_closed().await;
    node.assert_no_connection(Duration::from_millis(200)).await;
}
