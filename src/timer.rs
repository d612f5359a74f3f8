//! Timers kept from request to request, whose deadlines only move later.
//!
//! A connection's header-read timer and its upstream timer are tokio sleeps kept between
//! requests. Moving a sleep's deadline converts it to timer ticks and takes an atomic step
//! (120 to 160 instructions, callgrind), and one connection's deadlines only move later.
//! So a kept sleep is left at an earlier request's deadline, each request keeps its own, and
//! only when the sleep fires there (a connection idle, or an upstream slow, for that long)
//! is it armed again at the real one. A deadline earlier than the sleep's (a reload that
//! shortens a timeout) moves it at once.
//!
//! [`Kept`] also remembers the waker its last pending poll registered: while the sleep has not
//! fired, polling it again for the same task would change nothing, so it is not polled (a
//! poll re-registers the waker with the timer entry, about 100 instructions).

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};

use tokio::time::{Instant, Sleep};

/// Waits on `sleep` for `deadline`, which may be later than the sleep's own.
fn poll_until(sleep: &mut Pin<Box<Sleep>>, deadline: Instant, cx: &mut Context<'_>) -> Poll<()> {
    loop {
        if sleep.as_mut().poll(cx).is_pending() {
            return Poll::Pending;
        }
        if sleep.deadline() >= deadline {
            return Poll::Ready(());
        }
        sleep.as_mut().reset(deadline);
    }
}

/// Makes `sleep` fire no later than `deadline`; whether it had to be moved.
fn no_later_than(sleep: &mut Pin<Box<Sleep>>, deadline: Instant) -> bool {
    let later = sleep.deadline() > deadline;
    if later {
        sleep.as_mut().reset(deadline);
    }
    later
}

/// A sleep kept between requests, and the waker its last pending poll registered.
pub struct Kept {
    sleep: Pin<Box<Sleep>>,
    waker: Option<Waker>,
}

impl Kept {
    pub fn new(deadline: Instant) -> Self {
        Kept {
            sleep: Box::pin(tokio::time::sleep_until(deadline)),
            waker: None,
        }
    }

    /// [`poll_until`], skipped while the sleep is registered with this task and not fired.
    pub fn poll_until(&mut self, deadline: Instant, cx: &mut Context<'_>) -> Poll<()> {
        if let Some(waker) = &self.waker {
            if waker.will_wake(cx.waker()) && !self.sleep.is_elapsed() {
                return Poll::Pending;
            }
        }
        let polled = poll_until(&mut self.sleep, deadline, cx);
        self.waker = polled.is_pending().then(|| cx.waker().clone());
        polled
    }

    /// [`no_later_than`]; a moved sleep is polled again at its next wait.
    pub fn no_later_than(&mut self, deadline: Instant) {
        if no_later_than(&mut self.sleep, deadline) {
            self.waker = None;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// A sleep kept at an earlier deadline fires at the current one; one moved to an earlier
    /// deadline fires there.
    #[tokio::test(start_paused = true)]
    async fn a_sleep_kept_at_an_earlier_deadline_waits_for_the_current_one() {
        let start = Instant::now();
        let mut sleep = Box::pin(tokio::time::sleep_until(start + Duration::from_secs(1)));
        let deadline = start + Duration::from_secs(3);
        assert!(
            !no_later_than(&mut sleep, deadline),
            "moved, though earlier"
        );
        std::future::poll_fn(|cx| poll_until(&mut sleep, deadline, cx)).await;
        assert_eq!(Instant::now() - start, Duration::from_secs(3));

        let deadline = Instant::now() + Duration::from_secs(2);
        sleep
            .as_mut()
            .reset(Instant::now() + Duration::from_secs(10));
        assert!(
            no_later_than(&mut sleep, deadline),
            "not moved, though later"
        );
        std::future::poll_fn(|cx| poll_until(&mut sleep, deadline, cx)).await;
        assert_eq!(Instant::now() - start, Duration::from_secs(5));
    }
}
