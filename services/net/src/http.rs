//! Serving an axum app over a [`Listener`], in plain HTTP or TLS.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::Request;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio_rustls::rustls::ServerConfig;

use crate::listener::Listener;
use crate::refusals::HoldRefusals;

/// Serves `app` on `listener` (over TLS with `tls`) until `shutdown` resolves, then stops
/// accepting and waits for the open connections' requests to finish. HTTP/1 requests must
/// send their headers within the header-read timeout, which also closes kept-alive
/// connections left idle; HTTP/2 connections are pinged and carry at most `max_streams`
/// requests at once. Refusals (4xx but 408 and 429) to an address over the listener's
/// refusal budget are held.
pub async fn serve_http(
    listener: Listener,
    app: axum::Router,
    tls: Option<Arc<ServerConfig>>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) {
    let limits = *listener.limits();
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout)
        .keep_alive(true);
    builder
        .http2()
        .timer(TokioTimer::new())
        .keep_alive_interval(limits.keepalive_interval)
        .keep_alive_timeout(limits.keepalive_timeout)
        .max_concurrent_streams(limits.max_streams);
    let acceptor = tls.map(tokio_rustls::TlsAcceptor::from);
    let graceful = GracefulShutdown::new();
    let mut shutdown = std::pin::pin!(shutdown);
    let (refusals, name) = (listener.refusal_limiter(), listener.name());
    loop {
        let (conn, peer) = tokio::select! {
            accepted = listener.accept() => accepted,
            () = &mut shutdown => break,
        };
        let (builder, acceptor, watcher) = (builder.clone(), acceptor.clone(), graceful.watcher());
        let service = TowerToHyperService::new(HoldRefusals::for_peer(
            app.clone(),
            refusals.clone(),
            name,
            peer.ip(),
        ));
        tokio::spawn(async move {
            let served = match acceptor {
                None => {
                    let conn = builder
                        .serve_connection_with_upgrades(TokioIo::new(conn), service)
                        .into_owned();
                    watcher.watch(conn).await
                }
                Some(acceptor) => {
                    // The handshake is bounded like a request's headers.
                    let tls = match tokio::time::timeout(
                        limits.header_read_timeout,
                        acceptor.accept(conn),
                    )
                    .await
                    {
                        Ok(Ok(t)) => t,
                        Ok(Err(e)) => {
                            tracing::debug!(%peer, error = %e, "TLS handshake failed");
                            return;
                        }
                        Err(_) => {
                            tracing::debug!(%peer, "TLS handshake timed out");
                            return;
                        }
                    };
                    let conn = builder
                        .serve_connection_with_upgrades(TokioIo::new(tls), service)
                        .into_owned();
                    watcher.watch(conn).await
                }
            };
            if let Err(e) = served {
                tracing::debug!(%peer, error = %e, "HTTP connection ended with an error");
            }
        });
    }
    drop(listener);
    graceful.shutdown().await;
}

/// Why a request body could not be read.
#[derive(Debug, thiserror::Error)]
pub enum BodyError {
    #[error("the request body did not arrive within {0:?}; send it at once")]
    TooSlow(Duration),
    #[error("the request body is over {0} bytes")]
    TooLarge(usize),
    #[error("the request body could not be read: {0}")]
    Failed(String),
}

/// `req` with its body read whole: within `timeout` (a client that trickles its body holds a
/// connection and a task) and at most `max_bytes`.
pub async fn read_body_within(
    req: Request,
    timeout: Duration,
    max_bytes: usize,
) -> Result<Request, BodyError> {
    let (parts, body) = req.into_parts();
    match tokio::time::timeout(timeout, axum::body::to_bytes(body, max_bytes)).await {
        Err(_) => Err(BodyError::TooSlow(timeout)),
        Ok(Ok(bytes)) => Ok(Request::from_parts(parts, Body::from(bytes))),
        Ok(Err(e)) => {
            let e = e.into_inner();
            if e.is::<http_body_util::LengthLimitError>() {
                Err(BodyError::TooLarge(max_bytes))
            } else {
                Err(BodyError::Failed(e.to_string()))
            }
        }
    }
}
