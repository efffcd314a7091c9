//! A rank's progress lines, written to stderr by a thread of their own.
//!
//! Under `pipec launch` a rank's stderr is a pipe that mpirun drains through its event loop.
//! When a host becomes unreachable that loop can block for minutes on it, the pipe fills,
//! and a rank writing its step lines would block in the write: its training thread would
//! never reach the receive whose timeout ends the job, and the job would outlive its
//! timeout. So the training thread only queues its lines (dropping them while the queue is
//! full, and saying how many at the end); this thread alone may block on the pipe.

use std::io::Write;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{sync_channel, SyncSender, TrySendError};
use std::thread::JoinHandle;

/// Lines queued for a writer thread (see the module's documentation).
pub(crate) struct Lines {
    queue: Option<SyncSender<String>>,
    dropped: AtomicUsize,
    writer: Option<JoinHandle<()>>,
}

impl Lines {
    /// Lines for `sink`, at most `capacity` of them waiting at once.
    pub(crate) fn new<W: Write + Send + 'static>(mut sink: W, capacity: usize) -> Lines {
        let (queue, lines) = sync_channel::<String>(capacity.max(1));
        let writer = std::thread::Builder::new()
            .name("pipec-progress".into())
            .spawn(move || {
                for line in lines {
                    if writeln!(sink, "{line}").is_err() {
                        break;
                    }
                }
                let _ = sink.flush();
            })
            .ok();
        Lines { queue: writer.as_ref().map(|_| queue), dropped: AtomicUsize::new(0), writer }
    }

    /// Lines for this process's stderr.
    pub(crate) fn stderr() -> Lines {
        Lines::new(std::io::stderr(), 1024)
    }

    /// Queues `line`; never waits: a line that finds the queue full is dropped and counted.
    /// Without a writer thread (none could start) the line is written here.
    pub(crate) fn line(&self, line: String) {
        let Some(queue) = &self.queue else {
            eprintln!("{line}");
            return;
        };
        match queue.try_send(line) {
            Ok(()) | Err(TrySendError::Disconnected(_)) => {}
            Err(TrySendError::Full(_)) => {
                self.dropped.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// The lines dropped so far.
    pub(crate) fn dropped(&self) -> usize {
        self.dropped.load(Ordering::Relaxed)
    }

    /// Waits until every queued line is written, and says how many were dropped. For the
    /// end of a run that succeeded (its reader is draining the pipe); a failing run does
    /// not wait for a reader that may never come back.
    pub(crate) fn finish(mut self) {
        self.queue = None;
        if let Some(w) = self.writer.take() {
            let _ = w.join();
        }
        let n = self.dropped();
        if n > 0 {
            eprintln!("({n} progress line(s) were not printed: stderr was not read fast enough; metrics.jsonl has every step)");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc::{channel, Receiver};
    use std::sync::{Arc, Mutex};

    /// A sink whose every write waits until its gate closes, as a pipe nobody drains does.
    struct Stalled(Receiver<()>, Arc<Mutex<Vec<u8>>>);

    impl Write for Stalled {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            // blocks until the test drops the gate's sender
            let _ = self.0.recv();
            self.1.lock().map_err(|_| std::io::Error::other("poisoned"))?.extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn a_reader_that_stops_reading_never_blocks_the_caller_and_dropped_lines_are_counted() {
        let (gate, closed) = channel::<()>();
        let written = Arc::new(Mutex::new(Vec::new()));
        let lines = Lines::new(Stalled(closed, written.clone()), 4);
        // were `line` to wait for the sink, this loop would never end
        for i in 0..10_000 {
            lines.line(format!("step {i}"));
        }
        // the writer holds one line, the queue four: the rest were dropped
        let dropped = lines.dropped();
        assert!((10_000 - 5..10_000).contains(&dropped), "{dropped}");
        // the reader comes back: what was queued is written, in order
        drop(gate);
        lines.finish();
        let text = String::from_utf8(written.lock().expect("lock").clone()).expect("utf-8");
        let got: Vec<&str> = text.lines().collect();
        assert_eq!(got.len(), 10_000 - dropped, "{got:?}");
        assert_eq!(got.first(), Some(&"step 0"));
        let numbers: Vec<usize> = got.iter().map(|l| l["step ".len()..].parse().expect("a number")).collect();
        assert!(numbers.windows(2).all(|w| w[0] < w[1]), "{numbers:?}");
    }
}
