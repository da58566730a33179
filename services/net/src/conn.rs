//! One accepted connection: its place under the listener's cap, and the timeout for a client
//! that sends nothing.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::sync::OwnedSemaphorePermit;
use tokio::time::{Instant, Sleep};

/// A TCP connection that holds a place under its listener's connection cap until it is
/// dropped, and fails its reads and writes with `TimedOut` once the client has sent nothing
/// for `first` after it opened, or no byte has moved either way for `idle` since.
pub struct Conn {
    io: TcpStream,
    _place: OwnedSemaphorePermit,
    first: Duration,
    idle: Duration,
    /// When a byte last moved (or the connection opened).
    last: Instant,
    /// Whether the client has sent a byte.
    heard: bool,
    timer: Pin<Box<Sleep>>,
}

impl Conn {
    pub(crate) fn new(
        io: TcpStream,
        place: OwnedSemaphorePermit,
        first: Duration,
        idle: Duration,
    ) -> Self {
        let now = Instant::now();
        Self {
            io,
            _place: place,
            first,
            idle,
            last: now,
            heard: false,
            timer: Box::pin(tokio::time::sleep_until(now + first)),
        }
    }

    fn deadline(&self) -> Instant {
        self.last + if self.heard { self.idle } else { self.first }
    }

    /// Ready with an error once the connection has been silent past its deadline; otherwise
    /// pending, with the timer registered to wake `cx` then.
    fn poll_silence(&mut self, cx: &mut Context<'_>) -> Poll<io::Error> {
        loop {
            let deadline = self.deadline();
            if self.timer.deadline() != deadline {
                self.timer.as_mut().reset(deadline);
            }
            if self.timer.as_mut().poll(cx).is_pending() {
                return Poll::Pending;
            }
            if Instant::now() >= self.deadline() {
                let (what, after) = if self.heard {
                    ("no byte moved", self.idle)
                } else {
                    ("the client sent nothing", self.first)
                };
                return Poll::Ready(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("{what} for {after:?}: connection closed"),
                ));
            }
        }
    }

    fn moved(&mut self) {
        self.last = Instant::now();
    }
}

impl AsyncRead for Conn {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        match Pin::new(&mut this.io).poll_read(cx, buf) {
            Poll::Ready(Ok(())) => {
                if buf.filled().len() > before {
                    this.heard = true;
                    this.moved();
                }
                Poll::Ready(Ok(()))
            }
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
            Poll::Pending => this.poll_silence(cx).map(Err),
        }
    }
}

impl Conn {
    /// A write's outcome: bytes that went out reset the silence timer; a write that waits
    /// counts against it.
    fn written(
        &mut self,
        cx: &mut Context<'_>,
        r: Poll<io::Result<usize>>,
    ) -> Poll<io::Result<usize>> {
        match r {
            Poll::Ready(Ok(n)) => {
                if n > 0 {
                    self.moved();
                }
                Poll::Ready(Ok(n))
            }
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
            Poll::Pending => self.poll_silence(cx).map(Err),
        }
    }
}

impl AsyncWrite for Conn {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let r = Pin::new(&mut this.io).poll_write(cx, buf);
        this.written(cx, r)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let r = Pin::new(&mut this.io).poll_write_vectored(cx, bufs);
        this.written(cx, r)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }
}

impl tonic::transport::server::Connected for Conn {
    type ConnectInfo = tonic::transport::server::TcpConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.io.connect_info()
    }
}
