//! The park hook (see the module comment of [`super`]): a raise queued from a runtime thread
//! set up with [`defer_wakes_to_park`] wakes a busy writer when that runtime runs out of work,
//! not at once.

use super::*;

thread_local! {
    /// This thread runs a runtime whose park hook wakes the writers ([`defer_wakes_to_park`]).
    static PARKS_HERE: Cell<bool> = const { Cell::new(false) };
    /// Writers to wake when this thread's runtime parks.
    static DEFERRED: RefCell<Vec<Thread>> = const { RefCell::new(Vec::new()) };
}

/// Sets up `builder`'s runtime so that raises queued from its threads wake the embedded
/// store's writer when the runtime runs out of work, not one by one (see the module comment).
pub fn defer_wakes_to_park(builder: &mut tokio::runtime::Builder) {
    builder.on_thread_park(|| {
        PARKS_HERE.set(true);
        DEFERRED.with_borrow_mut(|writers| {
            for writer in writers.drain(..) {
                writer.unpark();
            }
        });
    });
}

/// Whether this thread's runtime was set up with [`defer_wakes_to_park`] and has parked since.
#[cfg(test)]
pub(crate) fn parks_here() -> bool {
    PARKS_HERE.get()
}

/// Wakes `writer` for an operation just queued: at once if this thread's runtime has no park
/// hook or the writer is `idle`, else when the runtime parks.
pub(super) fn wake(writer: &Thread, idle: &AtomicBool) {
    // Pairs with the fence in `writer` between marking itself idle and a last look at the
    // queue: either it sees this operation, or this sees it idle.
    fence(Ordering::SeqCst);
    if !PARKS_HERE.get() || idle.load(Ordering::Relaxed) {
        writer.unpark();
        return;
    }
    DEFERRED.with_borrow_mut(|writers| {
        if !writers.iter().any(|w| w.id() == writer.id()) {
            writers.push(writer.clone());
        }
    });
}
