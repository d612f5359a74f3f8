//! One way to take a `std::sync::Mutex`: [`Locked::locked`].
//!
//! A panic while a lock is held poisons it. Every lock fencegate keeps guards a map or a slot
//! that each critical section leaves whole (an insert, a remove, a swap), so what a panicking
//! holder left behind is still consistent, and the next taker goes on with it. Panicking again
//! instead would turn one failed request into every later request failing, or a sidecar that
//! stops renewing its leases.

use std::sync::{Mutex, MutexGuard, PoisonError};

/// [`Mutex::lock`], going on past a poisoned lock (see the [module docs](self)).
pub(crate) trait Locked<T> {
    fn locked(&self) -> MutexGuard<'_, T>;
}

impl<T> Locked<T> for Mutex<T> {
    fn locked(&self) -> MutexGuard<'_, T> {
        self.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use super::Locked;

    #[test]
    fn a_lock_whose_holder_panicked_is_taken_with_what_it_left() {
        let lock = Arc::new(Mutex::new(vec![1]));
        let held = Arc::clone(&lock);
        let panicked = std::thread::spawn(move || {
            let mut v = held.lock().unwrap();
            v.push(2);
            panic!("while holding the lock");
        })
        .join();
        assert!(panicked.is_err());
        assert!(lock.is_poisoned());
        assert_eq!(*lock.locked(), vec![1, 2]);
    }
}
