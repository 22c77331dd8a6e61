//! What an ADD has changed so far, undone in reverse if it fails.

/// Undo steps run in reverse order when dropped, unless [`Undo::commit`]
/// was called. Their own failures are logged: the ADD's error is the one
/// the runtime needs to see.
#[derive(Default)]
pub struct Undo<'a> {
    steps: Vec<(&'static str, Step<'a>)>,
}

type Step<'a> = Box<dyn FnOnce() -> Result<(), String> + 'a>;

impl<'a> Undo<'a> {
    pub fn push(&mut self, what: &'static str, step: impl FnOnce() -> Result<(), String> + 'a) {
        self.steps.push((what, Box::new(step)));
    }

    /// The ADD succeeded: keep everything.
    pub fn commit(mut self) {
        self.steps.clear();
    }
}

impl Drop for Undo<'_> {
    fn drop(&mut self) {
        while let Some((what, step)) = self.steps.pop() {
            if let Err(e) = step() {
                log::warn!("rollback: could not undo {what}: {e}");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::cell::RefCell;

    use super::*;

    #[test]
    fn undoes_in_reverse_unless_committed() {
        let log = RefCell::new(Vec::new());
        {
            let mut undo = Undo::default();
            undo.push("a", || {
                log.borrow_mut().push("a");
                Ok(())
            });
            undo.push("b", || {
                log.borrow_mut().push("b");
                Err("failed".into())
            });
            undo.push("c", || {
                log.borrow_mut().push("c");
                Ok(())
            });
        }
        assert_eq!(
            *log.borrow(),
            ["c", "b", "a"],
            "a failing step does not stop the others"
        );
        let mut undo = Undo::default();
        undo.push("x", || {
            log.borrow_mut().push("x");
            Ok(())
        });
        undo.commit();
        assert_eq!(log.borrow().len(), 3);
    }
}
