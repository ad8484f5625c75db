//! The one way leasehold calls code it did not write: a broker's acquire, release, renewal and
//! close, the GPU pool's close, a temp dir's removal, the error sink.
//!
//! Such a call can panic (in the call that builds its future, in any poll of it, or when it is
//! dropped) or never end. Every call goes through here, which does three things:
//!
//! - it **catches** the panic: [`first_poll`] builds the future and polls it once under
//!   `catch_unwind`; [`finish`] runs the rest in a task of its own under `catch_unwind`, its
//!   drop included;
//! - it **bounds** the call: [`finish`] takes the bound (none only for a broker acquire, which
//!   may queue for as long as its caller waits: the caller's own timeout and cancellation end
//!   it);
//! - it **reports** every outcome, once, as an [`Outcome`], which the caller turns into an input
//!   of the supervisor's core. A task that reports nothing cannot happen: the report runs
//!   whatever the call did.
//!
//! Nothing here decides what a panic means for a slot: the core does, from the input.

use std::any::Any;
use std::future::Future;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::pin::Pin;
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use futures_util::FutureExt;
use futures_util::future::BoxFuture;
use tokio::task::AbortHandle;

/// How a call into outside code ended.
#[derive(Debug)]
pub(crate) enum Outcome<T> {
    /// It answered.
    Done(T),
    /// It panicked, with this message.
    Panicked(String),
    /// It did not answer within its bound (its future has been dropped).
    TimedOut(Duration),
}

impl<T> Outcome<T> {
    /// Maps each way the call can end to one value of the caller's own.
    pub(crate) fn fold<R>(
        self,
        done: impl FnOnce(T) -> R,
        panicked: impl FnOnce(String) -> R,
        timed_out: impl FnOnce(Duration) -> R,
    ) -> R {
        match self {
            Self::Done(value) => done(value),
            Self::Panicked(message) => panicked(message),
            Self::TimedOut(bound) => timed_out(bound),
        }
    }
}

/// The first poll of an outside call.
pub(crate) enum First<T> {
    /// Answered (or panicked) on its first poll: nothing is left to run.
    Ended(Outcome<T>),
    /// Not ready: finish it with [`finish`] (the future never ran in a task yet).
    Pending(BoxFuture<'static, T>),
}

/// Builds the call's future with `make` and polls it once with a no-op waker, catching a panic
/// in either (and in the drop of a future that panicked).
///
/// An outside call that answers at once (an in-memory broker) costs no task and no message. A
/// future that returns `Pending` is moved, unchanged, into [`finish`], whose first poll registers
/// the real waker: a well-behaved future re-registers on every poll, so the no-op waker of this
/// first poll is never relied upon.
pub(crate) fn first_poll<T>(make: impl FnOnce() -> BoxFuture<'static, T>) -> First<T> {
    let polled = call(|| {
        let mut fut = make();
        match poll_once(&mut fut) {
            Poll::Ready(value) => Ok(value),
            Poll::Pending => Err(fut),
        }
    });
    match polled {
        Ok(Ok(value)) => First::Ended(Outcome::Done(value)),
        Ok(Err(fut)) => First::Pending(fut),
        Err(panic) => First::Ended(Outcome::Panicked(panic)),
    }
}

/// Polls `fut` once with a no-op waker (no catching: see [`first_poll`]).
fn poll_once<T>(fut: &mut Pin<Box<dyn Future<Output = T> + Send>>) -> Poll<T> {
    let mut cx = Context::from_waker(Waker::noop());
    fut.as_mut().poll(&mut cx)
}

/// Runs `fut` to its end in a task of its own, under `bound` when there is one, catching its
/// panic (its drop at the bound included), and hands the outcome to `report`, which runs
/// exactly once whatever the call did.
///
/// Aborting the returned handle drops the call (tokio catches a panic in that drop) and skips
/// its report: for a call the core no longer wants.
pub(crate) fn finish<T, R>(
    fut: BoxFuture<'static, T>,
    bound: Option<Duration>,
    report: R,
) -> AbortHandle
where
    T: Send + 'static,
    R: FnOnce(Outcome<T>) + Send + 'static,
{
    crate::counters::task();
    tokio::spawn(run(fut, bound, report)).abort_handle()
}

/// [`finish`] for a call whose future is built inside the task (nothing to poll in the caller's
/// turn: a renewal, a close), so that a panic while building it is caught too.
pub(crate) fn spawn<T, M, R>(make: M, bound: Option<Duration>, report: R) -> AbortHandle
where
    T: Send + 'static,
    M: FnOnce() -> BoxFuture<'static, T> + Send + 'static,
    R: FnOnce(Outcome<T>) + Send + 'static,
{
    crate::counters::task();
    tokio::spawn(async move {
        match call(make) {
            Ok(fut) => run(fut, bound, report).await,
            Err(panic) => report(Outcome::Panicked(panic)),
        }
    })
    .abort_handle()
}

/// Runs `fut` under `bound` (none: to its end), its panic caught, and hands the outcome to
/// `report`.
async fn run<T, R>(fut: BoxFuture<'static, T>, bound: Option<Duration>, report: R)
where
    R: FnOnce(Outcome<T>),
{
    let bounded = caught(async move {
        match bound {
            Some(bound) => tokio::time::timeout(bound, fut).await.map_err(|_| bound),
            None => Ok(fut.await),
        }
    });
    report(match bounded.await {
        Ok(Ok(value)) => Outcome::Done(value),
        Ok(Err(bound)) => Outcome::TimedOut(bound),
        Err(panic) => Outcome::Panicked(panic),
    });
}

/// `fut` with its panic caught: `Err` carries the panic's message. For a call that is awaited
/// past a first bound (a temp dir's removal: late at the cleanup timeout, awaited all the same).
pub(crate) fn caught<F: Future>(fut: F) -> impl Future<Output = Result<F::Output, String>> {
    AssertUnwindSafe(fut)
        .catch_unwind()
        .map(|result| result.map_err(message_of))
}

/// Calls code leasehold did not write synchronously (the error sink, a hook, a GPU backend
/// call, a host building its future), catching its panic: `Err` carries the panic's message.
pub(crate) fn call<T>(f: impl FnOnce() -> T) -> Result<T, String> {
    catch_unwind(AssertUnwindSafe(f)).map_err(message_of)
}

/// A caught panic's message; the payload itself is disposed of (see [`dispose`]). Every panic
/// leasehold catches goes through here: its payload is a value the panicking code chose, and
/// its `Drop` may panic too.
pub(crate) fn message_of(payload: Box<dyn Any + Send>) -> String {
    let message = panic_message(&*payload);
    dispose(payload);
    message
}

/// Drops a value leasehold did not write (a panic's payload, a job's closure, a broker) under
/// the panic catch. A drop that panics is not retried: what is left of the value is leaked, and
/// so is the payload of that second panic (its drop could panic again). Several such values are
/// disposed of one by one, never as one collection: a second panic while the first unwinds
/// would abort the process.
pub(crate) fn dispose<T>(value: T) {
    if let Err(again) = catch_unwind(AssertUnwindSafe(move || drop(value))) {
        tracing::error!(panic = %panic_message(&*again), "a value leasehold did not write panicked while it was dropped; it was leaked");
        std::mem::forget(again);
    }
}

/// Drops a value leasehold did not write away from the caller's thread: on tokio's blocking
/// pool when a runtime is current, so that a `Drop` that blocks holds a blocking thread, never
/// the supervisor's turn; under the panic catch ([`dispose`]). Without a runtime (it is being
/// dropped), here.
pub(crate) fn dispose_off_turn<T: Send + 'static>(value: T) {
    match tokio::runtime::Handle::try_current() {
        Ok(runtime) => {
            crate::counters::task();
            drop(runtime.spawn_blocking(move || dispose(value)));
        }
        Err(_) => dispose(value),
    }
}

/// A panic's message, when it carries one (`panic!` with a literal or a format string).
pub(crate) fn panic_message(payload: &(dyn Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&'static str>() {
        (*s).to_owned()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "non-string panic payload".to_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_panic_while_building_or_on_the_first_poll_is_caught_with_its_message() {
        let built: First<()> = first_poll(|| panic!("while building"));
        assert!(matches!(built, First::Ended(Outcome::Panicked(m)) if m == "while building"));
        let polled: First<()> = first_poll(|| Box::pin(async { panic!("polled {}", 1) }));
        assert!(matches!(polled, First::Ended(Outcome::Panicked(m)) if m == "polled 1"));
        let ready = first_poll(|| Box::pin(async { 7 }));
        assert!(matches!(ready, First::Ended(Outcome::Done(7))));
        let pending: First<()> = first_poll(|| Box::pin(std::future::pending()));
        assert!(matches!(pending, First::Pending(_)));
    }

    #[tokio::test(start_paused = true)]
    async fn a_finished_call_reports_once_whether_it_answers_panics_or_hangs() {
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let report = |tx: tokio::sync::mpsc::UnboundedSender<String>| {
            move |o: Outcome<u8>| {
                let _ = tx.send(o.fold(|v| format!("done {v}"), |m| m, |b| format!("{b:?}")));
            }
        };
        let _ = finish(Box::pin(async { 3 }), None, report(tx.clone()));
        let _ = finish(
            Box::pin(async {
                tokio::task::yield_now().await;
                panic!("after an await")
            }),
            Some(Duration::from_secs(1)),
            report(tx.clone()),
        );
        let _ = finish(
            Box::pin(std::future::pending()),
            Some(Duration::from_secs(2)),
            report(tx.clone()),
        );
        let _ = spawn(|| panic!("building"), None, report(tx));
        let mut heard = Vec::new();
        while let Some(line) = rx.recv().await {
            heard.push(line);
        }
        heard.sort();
        assert_eq!(heard, ["2s", "after an await", "building", "done 3"]);
    }

    /// A panic payload whose own drop panics.
    struct Bomb;

    impl Drop for Bomb {
        fn drop(&mut self) {
            panic!("the payload's drop");
        }
    }

    #[test]
    fn a_panic_whose_payload_panics_when_dropped_is_caught_and_the_payload_leaked() {
        let caught = call(|| std::panic::panic_any(Bomb));
        assert_eq!(caught.unwrap_err(), "non-string panic payload");
        let first: First<()> = first_poll(|| Box::pin(async { std::panic::panic_any(Bomb) }));
        assert!(matches!(first, First::Ended(Outcome::Panicked(_))));
    }

    #[tokio::test(start_paused = true)]
    async fn a_call_that_panics_with_a_payload_that_panics_when_dropped_still_reports_once() {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let _ = finish(
            Box::pin(async {
                tokio::task::yield_now().await;
                std::panic::panic_any(Bomb)
            }),
            None,
            move |o: Outcome<()>| {
                let _ = tx.send(o.fold(|()| "done".to_owned(), |m| m, |_| "timed out".into()));
            },
        );
        assert_eq!(rx.await.unwrap(), "non-string panic payload");
    }

    #[test]
    fn a_value_whose_drop_panics_is_disposed_of_without_unwinding_into_the_caller() {
        dispose(Bomb);
        dispose(Bomb);
    }

    #[tokio::test(start_paused = true)]
    async fn a_future_whose_drop_panics_at_its_bound_is_reported_as_a_panic() {
        struct PanicOnDrop;
        impl Drop for PanicOnDrop {
            fn drop(&mut self) {
                panic!("in drop");
            }
        }
        let fut = async {
            let _guard = PanicOnDrop;
            std::future::pending::<()>().await;
        };
        let (tx, rx) = tokio::sync::oneshot::channel();
        run(Box::pin(fut), Some(Duration::from_millis(1)), move |o| {
            let _ = tx.send(o);
        })
        .await;
        let outcome = rx.await.unwrap();
        assert!(
            matches!(&outcome, Outcome::Panicked(m) if m == "in drop"),
            "{outcome:?}"
        );
    }
}
