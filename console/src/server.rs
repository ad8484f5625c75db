//! The console's HTTP server, whose limits come from hyper's own connection settings and
//! tokio-io-timeout's: a client that does not send its request headers within the header-read
//! timeout (a slow client trickling them, or one that connects and sends nothing, or a
//! kept-alive connection left idle) is closed by hyper; a client that stops reading, so that a
//! write to its socket makes no progress for the write timeout (an event stream's or a large
//! answer's), is closed by the socket's `TimeoutStream` (hyper 1 has no write timeout); a
//! connection beyond the connection cap is closed at once. So a flood of slow clients costs the
//! console its own connections, never a job's file descriptors: the console holds at most
//! `max_connections` sockets and its listener, and none of them for ever.

use std::io;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio_io_timeout::TimeoutStream;
use tokio_util::sync::CancellationToken;

/// How long the accept loop pauses after the operating system refused to accept (out of file
/// descriptors, say), so that it does not spin while the process is starved.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(50);

/// What one client can hold.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Limits {
    pub(crate) max_connections: usize,
    pub(crate) header_read_timeout: Duration,
    pub(crate) write_timeout: Duration,
}

/// Serves `router` on `listener` until `stop`, then lets the connections in progress end (the
/// caller bounds that wait; event streams end on `stop` by themselves).
pub(crate) async fn serve(
    listener: TcpListener,
    router: Router,
    limits: Limits,
    stop: CancellationToken,
) -> io::Result<()> {
    let permits = Arc::new(Semaphore::new(limits.max_connections));
    let graceful = GracefulShutdown::new();
    let mut http = http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout)
        .keep_alive(true);
    loop {
        let stream = tokio::select! {
            () = stop.cancelled() => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, _peer)) => stream,
                Err(error) => {
                    tracing::warn!(%error, "the console could not accept a connection");
                    tokio::time::sleep(ACCEPT_BACKOFF).await;
                    continue;
                }
            },
        };
        // Beyond the cap: closed at once, before anything is read.
        let Ok(permit) = Arc::clone(&permits).try_acquire_owned() else {
            drop(stream);
            continue;
        };
        // A write (or flush, or shutdown) that makes no progress for the write timeout fails
        // with `TimedOut`, which ends the connection: a client that stops reading cannot hold
        // it. Any progress restarts the bound, so a slow reader is served.
        let mut stream = TimeoutStream::new(stream);
        stream.set_write_timeout(Some(limits.write_timeout));
        let service = TowerToHyperService::new(router.clone());
        let connection =
            graceful.watch(http.serve_connection(TokioIo::new(Box::pin(stream)), service));
        tokio::spawn(async move {
            // A connection that ends in an error (the header-read or the write timeout among
            // them) is the client's affair: it is closed, and its places (the connection's,
            // an event stream's) freed.
            let _ = connection.await;
            drop(permit);
        });
    }
    drop(listener);
    graceful.shutdown().await;
    Ok(())
}
