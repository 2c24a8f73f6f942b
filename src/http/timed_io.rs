//! [`WriteDeadline`]: a connection's I/O whose writes fail once the peer
//! has taken nothing for a set time. A client that stops reading (a slow
//! SSE reader, a non-streamed answer never read) would otherwise hold its
//! connection, its task and the buffered response forever; the failed write
//! makes hyper close the connection and drop the response, which cancels
//! the request in the engine.

use hyper::rt::{Read, ReadBufCursor, Write};
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::time::{Instant, Sleep};

/// Wraps `io` so that a write pending for longer than `limit` without any
/// progress fails with `TimedOut`.
pub struct WriteDeadline<T> {
    io: T,
    limit: Duration,
    /// Armed while a write is pending; cleared by any progress.
    stall: Option<Pin<Box<Sleep>>>,
}

impl<T> WriteDeadline<T> {
    pub fn new(io: T, limit: Duration) -> Self {
        Self {
            io,
            limit,
            stall: None,
        }
    }

    /// Called when a write returned `Pending`: arms the deadline on the
    /// first stall and fails once it has passed. Polling the timer
    /// registers the task's waker, so the connection is woken to fail even
    /// if the socket never becomes writable again.
    fn stalled(&mut self, cx: &mut Context<'_>) -> Poll<io::Error> {
        let limit = self.limit;
        let timer = self
            .stall
            .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(Instant::now() + limit)));
        match timer.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(io::Error::new(
                io::ErrorKind::TimedOut,
                format!(
                    "the peer took no response bytes for {} s",
                    limit.as_secs_f64()
                ),
            )),
            Poll::Pending => Poll::Pending,
        }
    }

    fn watch<R>(&mut self, cx: &mut Context<'_>, r: Poll<io::Result<R>>) -> Poll<io::Result<R>> {
        match r {
            Poll::Pending => self.stalled(cx).map(Err),
            ready => {
                self.stall = None;
                ready
            }
        }
    }
}

impl<T: Read + Unpin> Read for WriteDeadline<T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: ReadBufCursor<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_read(cx, buf)
    }
}

impl<T: Write + Unpin> Write for WriteDeadline<T> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let r = Pin::new(&mut this.io).poll_write(cx, buf);
        this.watch(cx, r)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let r = Pin::new(&mut this.io).poll_flush(cx);
        this.watch(cx, r)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let r = Pin::new(&mut this.io).poll_shutdown(cx);
        this.watch(cx, r)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let r = Pin::new(&mut this.io).poll_write_vectored(cx, bufs);
        this.watch(cx, r)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hyper_util::rt::TokioIo;

    /// Writes to a peer that never reads stall, then fail once the limit
    /// has passed without progress.
    #[tokio::test(start_paused = true)]
    async fn a_write_stalled_past_the_limit_fails() {
        let (a, _peer) = tokio::io::duplex(64);
        let mut io = WriteDeadline::new(TokioIo::new(a), Duration::from_secs(3));
        let chunk = [7u8; 32];
        let started = Instant::now();
        let err = loop {
            let r = std::future::poll_fn(|cx| Pin::new(&mut io).poll_write(cx, &chunk)).await;
            match r {
                Ok(_) => continue,
                Err(e) => break e,
            }
        };
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
        assert!(started.elapsed() >= Duration::from_secs(3));
    }
}
