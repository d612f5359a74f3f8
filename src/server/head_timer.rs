//! The timer hyper uses for one connection's request heads (`timeouts.header_read`), keeping one
//! tokio sleep per connection instead of one per request.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use crate::sync::Locked;
use crate::timer::Kept;

type IdleSleep = Arc<Mutex<Option<Kept>>>;

/// hyper's timer for one connection's request heads (`timeouts.header_read`).
///
/// hyper asks its timer for a new sleep for every request head and drops it once the head is
/// in. With tokio's own timer that is a timer-wheel entry registered and removed per request,
/// each under the timer driver's lock. This timer keeps one tokio sleep per connection, not
/// moved to each head's later deadline ([`crate::timer`]), and not polled again while it is
/// registered with the connection's waker. So a head costs no timer work at all, where moving
/// the deadline and polling would cost about 300 instructions (callgrind, fixed 1,000
/// GET/s), and a new sleep per head about 700.
#[derive(Default)]
pub(super) struct HeadTimer(IdleSleep);

/// The sleep hyper holds while it reads one head; the tokio sleep under it goes back to the
/// connection when hyper drops it.
struct HeadSleep {
    kept: Option<Kept>,
    deadline: tokio::time::Instant,
    home: IdleSleep,
}

impl hyper::rt::Timer for HeadTimer {
    fn sleep(&self, duration: Duration) -> Pin<Box<dyn hyper::rt::Sleep>> {
        self.sleep_until(self.now() + duration)
    }

    fn sleep_until(&self, deadline: std::time::Instant) -> Pin<Box<dyn hyper::rt::Sleep>> {
        let deadline = tokio::time::Instant::from_std(deadline);
        let idle = self.0.locked().take();
        let kept = match idle {
            Some(mut kept) => {
                kept.no_later_than(deadline);
                kept
            }
            None => Kept::new(deadline),
        };
        Box::pin(HeadSleep {
            kept: Some(kept),
            deadline,
            home: Arc::clone(&self.0),
        })
    }

    fn reset(&self, sleep: &mut Pin<Box<dyn hyper::rt::Sleep>>, new_deadline: std::time::Instant) {
        if let Some(head) = sleep.as_mut().downcast_mut_pin::<HeadSleep>() {
            let head = head.get_mut();
            head.deadline = tokio::time::Instant::from_std(new_deadline);
            if let Some(kept) = head.kept.as_mut() {
                kept.no_later_than(head.deadline);
            }
        }
    }

    fn now(&self) -> std::time::Instant {
        // tokio's clock, so that a paused test clock governs the deadlines too.
        tokio::time::Instant::now().into_std()
    }
}

impl Future for HeadSleep {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let this = self.get_mut();
        match this.kept.as_mut() {
            Some(kept) => kept.poll_until(this.deadline, cx),
            None => Poll::Ready(()),
        }
    }
}

impl hyper::rt::Sleep for HeadSleep {}

impl Drop for HeadSleep {
    fn drop(&mut self) {
        if let (Some(kept), Ok(mut home)) = (self.kept.take(), self.home.lock()) {
            *home = Some(kept);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hyper::rt::Timer;
    use std::future::poll_fn;

    fn pending(sleep: &mut Pin<Box<dyn hyper::rt::Sleep>>) -> bool {
        let mut cx = Context::from_waker(std::task::Waker::noop());
        sleep.as_mut().poll(&mut cx).is_pending()
    }

    async fn fires(sleep: &mut Pin<Box<dyn hyper::rt::Sleep>>) {
        poll_fn(|cx| sleep.as_mut().poll(cx)).await;
    }

    /// Each head gets the deadline it asked for, though the tokio sleep under it is reused.
    #[tokio::test(start_paused = true)]
    async fn a_reused_sleep_fires_at_the_new_deadline_not_the_old() {
        let timer = HeadTimer::default();
        let start = timer.now();
        let mut first = timer.sleep_until(start + Duration::from_secs(10));
        assert!(pending(&mut first));
        drop(first);
        assert!(timer.0.lock().unwrap().is_some(), "the sleep went back");

        tokio::time::advance(Duration::from_secs(4)).await;
        let mut second = timer.sleep_until(timer.now() + Duration::from_secs(10));
        assert!(
            timer.0.lock().unwrap().is_none(),
            "the kept sleep is reused"
        );
        // Past the first deadline (10 s), short of the second (14 s).
        tokio::time::advance(Duration::from_secs(8)).await;
        assert!(pending(&mut second), "fired at the old deadline");
        tokio::time::advance(Duration::from_secs(2)).await;
        fires(&mut second).await;
        assert_eq!(timer.now() - start, Duration::from_secs(14));
    }

    /// A sleep that fired while kept (an upstream slower than `header_read`) is armed again.
    #[tokio::test(start_paused = true)]
    async fn a_kept_sleep_that_fired_is_armed_again() {
        let timer = HeadTimer::default();
        let start = timer.now();
        drop(timer.sleep_until(start + Duration::from_secs(1)));
        tokio::time::advance(Duration::from_secs(5)).await;
        let mut next = timer.sleep_until(timer.now() + Duration::from_secs(1));
        assert!(pending(&mut next), "a fired sleep was handed out as fired");
        fires(&mut next).await;
        assert_eq!(timer.now() - start, Duration::from_secs(6));
    }

    /// hyper's `reset` moves the deadline of the sleep it holds.
    #[tokio::test(start_paused = true)]
    async fn reset_moves_the_deadline() {
        let timer = HeadTimer::default();
        let start = timer.now();
        let mut sleep = timer.sleep(Duration::from_secs(1));
        timer.reset(&mut sleep, start + Duration::from_secs(3));
        tokio::time::advance(Duration::from_secs(2)).await;
        assert!(pending(&mut sleep));
        fires(&mut sleep).await;
        assert_eq!(timer.now() - start, Duration::from_secs(3));
    }
}
