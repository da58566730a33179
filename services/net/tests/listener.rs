//! The listener's cap and the connections' silence timeouts, on loopback.

use std::time::{Duration, Instant};

use futures::StreamExt;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use wavefront_net::{Listener, ServerLimits};

async fn listener(limits: ServerLimits) -> Listener {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    Listener::new(l, limits, "test")
}

fn limits(max_connections: usize, first: Duration, idle: Duration) -> ServerLimits {
    ServerLimits {
        max_connections,
        header_read_timeout: first,
        idle_timeout: idle,
        ..ServerLimits::default()
    }
}

/// At most `max_connections` are open; the next is accepted once one closes.
#[tokio::test]
async fn connections_beyond_the_cap_wait_until_one_closes() {
    let l = listener(limits(2, Duration::from_secs(30), Duration::from_secs(30))).await;
    let addr = l.local_addr().unwrap();
    let _clients: Vec<TcpStream> =
        futures::future::join_all((0..3).map(|_| TcpStream::connect(addr)))
            .await
            .into_iter()
            .map(Result::unwrap)
            .collect();
    let (a, _) = l.accept().await;
    let (_b, _) = l.accept().await;
    assert_eq!(l.open(), 2);
    let third = tokio::time::timeout(Duration::from_millis(200), l.accept()).await;
    assert!(
        third.is_err(),
        "a third connection was accepted past the cap"
    );
    drop(a);
    let (_c, _) = tokio::time::timeout(Duration::from_secs(2), l.accept())
        .await
        .expect("accepted once a place was free");
    assert_eq!(l.open(), 2);
}

/// A client that sends nothing is cut off after the first-byte timeout; one that goes quiet
/// after talking, after the idle timeout; one that keeps talking, never.
#[tokio::test]
async fn silent_connections_are_closed_and_talking_ones_are_not() {
    let first = Duration::from_millis(300);
    let idle = Duration::from_millis(600);
    let l = listener(limits(8, first, idle)).await;
    let addr = l.local_addr().unwrap();

    let _silent = TcpStream::connect(addr).await.unwrap();
    let (mut conn, _) = l.accept().await;
    let t = Instant::now();
    let mut buf = [0u8; 16];
    let err = conn.read(&mut buf).await.expect_err("timed out");
    assert_eq!(err.kind(), std::io::ErrorKind::TimedOut, "{err}");
    let waited = t.elapsed();
    assert!(waited >= first && waited < first * 4, "{waited:?}");

    let mut quiet = TcpStream::connect(addr).await.unwrap();
    let (mut conn, _) = l.accept().await;
    quiet.write_all(b"x").await.unwrap();
    assert_eq!(conn.read(&mut buf).await.unwrap(), 1);
    let t = Instant::now();
    let err = conn.read(&mut buf).await.expect_err("timed out");
    assert_eq!(err.kind(), std::io::ErrorKind::TimedOut, "{err}");
    let waited = t.elapsed();
    assert!(waited >= idle && waited < idle * 4, "{waited:?}");

    // A byte every 200 ms, each before the deadline: read for 1.5 s, never cut off.
    let mut talker = TcpStream::connect(addr).await.unwrap();
    let (mut conn, _) = l.accept().await;
    let writer = tokio::spawn(async move {
        for _ in 0..8 {
            talker.write_all(b"y").await.unwrap();
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        talker
    });
    let mut got = 0;
    while got < 8 {
        got += conn.read(&mut buf).await.expect("still open");
    }
    drop(writer.await.unwrap());
}

/// Writing counts as activity: a response that keeps flowing to a client that sends nothing
/// more is not cut off.
#[tokio::test]
async fn a_flowing_response_keeps_the_connection_open() {
    let idle = Duration::from_millis(300);
    let l = listener(limits(8, idle, idle)).await;
    let addr = l.local_addr().unwrap();
    let mut client = TcpStream::connect(addr).await.unwrap();
    let (mut conn, _) = l.accept().await;
    client.write_all(b"request").await.unwrap();
    let mut request = [0u8; 7];
    conn.read_exact(&mut request).await.unwrap();
    let reader = tokio::spawn(async move {
        let mut all = Vec::new();
        client.read_to_end(&mut all).await.unwrap();
        all.len()
    });
    for _ in 0..10 {
        conn.write_all(b"token ").await.unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    drop(conn);
    assert_eq!(reader.await.unwrap(), 60);
}

/// A body that never finishes is given up after the timeout; one over the limit is refused;
/// a whole one passes on unchanged.
#[tokio::test]
async fn request_bodies_are_read_within_the_timeout_and_the_limit() {
    use axum::body::Body;
    use axum::extract::Request;
    use wavefront_net::{read_body_within, BodyError};

    let trickle = futures::stream::once(async { Ok::<_, std::io::Error>(vec![b'{']) })
        .chain(futures::stream::pending());
    let req = Request::new(Body::from_stream(trickle));
    let t = Instant::now();
    let e = read_body_within(req, Duration::from_millis(200), 1024)
        .await
        .expect_err("too slow");
    assert!(matches!(e, BodyError::TooSlow(_)), "{e}");
    assert!(t.elapsed() < Duration::from_secs(2));

    let req = Request::new(Body::from(vec![b'x'; 2048]));
    let e = read_body_within(req, Duration::from_secs(1), 1024)
        .await
        .expect_err("too large");
    assert!(matches!(e, BodyError::TooLarge(1024)), "{e}");

    let req = Request::new(Body::from("{\"a\": 1}"));
    let req = read_body_within(req, Duration::from_secs(1), 1024)
        .await
        .unwrap();
    let bytes = axum::body::to_bytes(req.into_body(), 1024).await.unwrap();
    assert_eq!(&bytes[..], b"{\"a\": 1}");
}
