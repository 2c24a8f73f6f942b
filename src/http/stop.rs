//! Stop strings over streamed text: emits text as soon as it cannot be the
//! start of a stop string, holds back a suffix that still might be, and
//! cuts the output right before a stop string once one appears. So a
//! stream never leaks a partial stop string and never waits longer than it
//! must.
//!
//! [`OffsetQueue`] carries what rides along the text (each token's
//! log-probabilities) through such holdbacks: items wait until the text
//! they end at has been released.

use std::collections::VecDeque;

/// Items keyed by the text offset (bytes fed so far) they end at, released
/// in order once the released text reaches that offset.
#[derive(Debug)]
pub struct OffsetQueue<T> {
    items: VecDeque<(usize, T)>,
}

impl<T> Default for OffsetQueue<T> {
    fn default() -> Self {
        Self {
            items: VecDeque::new(),
        }
    }
}

impl<T> OffsetQueue<T> {
    /// Queues `items`, all ending at offset `end`. Invariant kept by
    /// callers: `end` never decreases between calls.
    pub fn push(&mut self, end: usize, items: impl IntoIterator<Item = T>) {
        self.items.extend(items.into_iter().map(|t| (end, t)));
    }

    /// Takes every item ending at or before `released`.
    pub fn take_until(&mut self, released: usize) -> Vec<T> {
        let n = self
            .items
            .iter()
            .take_while(|(e, _)| *e <= released)
            .count();
        self.items.drain(..n).map(|(_, t)| t).collect()
    }

    /// Takes everything queued.
    pub fn take_all(&mut self) -> Vec<T> {
        self.items.drain(..).map(|(_, t)| t).collect()
    }
}

/// Incremental stop-string matcher for one response.
pub struct StopMatcher {
    stops: Vec<String>,
    held: String,
    /// The stop string that ended the output, once one did.
    matched: Option<usize>,
}

/// What a piece of text produced.
#[derive(Debug, PartialEq, Eq)]
pub struct Matched {
    /// Text that is safe to send now.
    pub emit: String,
    /// A stop string appeared: the output ends after `emit`.
    pub stopped: bool,
}

impl StopMatcher {
    /// Empty stop strings are ignored.
    pub fn new(stops: &[String]) -> Self {
        Self {
            stops: stops.iter().filter(|s| !s.is_empty()).cloned().collect(),
            held: String::new(),
            matched: None,
        }
    }

    /// Feeds newly generated text.
    pub fn push(&mut self, text: &str) -> Matched {
        self.held.push_str(text);
        if self.stops.is_empty() {
            return Matched {
                emit: std::mem::take(&mut self.held),
                stopped: false,
            };
        }
        if let Some((pos, which)) = self
            .stops
            .iter()
            .enumerate()
            .filter_map(|(i, s)| self.held.find(s.as_str()).map(|p| (p, i)))
            .min()
        {
            self.matched = Some(which);
            let emit = self.held[..pos].to_string();
            self.held.clear();
            return Matched {
                emit,
                stopped: true,
            };
        }
        // Hold back the longest suffix that is a prefix of some stop string.
        let mut keep = 0;
        for s in &self.stops {
            for (i, _) in self.held.char_indices() {
                let tail = &self.held[i..];
                if tail.len() > keep && s.starts_with(tail) {
                    keep = tail.len();
                }
            }
        }
        let cut = self.held.len() - keep;
        let emit = self.held[..cut].to_string();
        self.held.drain(..cut);
        Matched {
            emit,
            stopped: false,
        }
    }

    /// The stop string that ended the output (the earliest in the text;
    /// of two starting at one place, the first given), once one did.
    pub fn matched(&self) -> Option<&str> {
        self.matched.map(|i| self.stops[i].as_str())
    }

    /// The generation ended without a stop string: release what was held.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], pieces: &[&str]) -> (String, bool) {
        let stops: Vec<String> = stops.iter().map(|s| s.to_string()).collect();
        let mut m = StopMatcher::new(&stops);
        let mut out = String::new();
        for p in pieces {
            let r = m.push(p);
            out.push_str(&r.emit);
            if r.stopped {
                return (out, true);
            }
        }
        out.push_str(&m.finish());
        (out, false)
    }

    #[test]
    fn stop_spanning_pieces_is_cut_and_never_leaked() {
        let stops: Vec<String> = vec!["END".into()];
        let mut m = StopMatcher::new(&stops);
        assert_eq!(m.push("abc E").emit, "abc ");
        assert_eq!(m.push("N").emit, "");
        let r = m.push("D tail");
        assert_eq!(
            r,
            Matched {
                emit: String::new(),
                stopped: true
            }
        );
        assert_eq!(run(&["END"], &["x", "EN", "Dy"]), ("x".into(), true));
    }

    #[test]
    fn offset_queue_releases_in_order() {
        let mut q = OffsetQueue::default();
        q.push(3, [1, 2]);
        q.push(3, []);
        q.push(5, [3]);
        assert_eq!(q.take_until(2), Vec::<i32>::new());
        assert_eq!(q.take_until(4), vec![1, 2]);
        assert_eq!(q.take_until(4), Vec::<i32>::new());
        q.push(9, [4]);
        assert_eq!(q.take_until(5), vec![3]);
        assert_eq!(q.take_all(), vec![4]);
    }

    #[test]
    fn false_starts_are_released() {
        assert_eq!(run(&["END"], &["E", "Nx", "!"]), ("ENx!".into(), false));
        assert_eq!(run(&["END"], &["abc", "E"]), ("abcE".into(), false));
    }

    #[test]
    fn earliest_of_several_stops_wins_and_multibyte_is_safe() {
        assert_eq!(run(&["zz", "é!"], &["caf", "é!zz"]), ("caf".into(), true));
        let stops: Vec<String> = vec!["zz".into(), "é!".into()];
        let mut m = StopMatcher::new(&stops);
        assert_eq!(m.matched(), None);
        assert!(m.push("café!zz").stopped);
        assert_eq!(m.matched(), Some("é!"));
        assert_eq!(run(&["日本"], &["こん日", "x"]), ("こん日x".into(), false));
        assert_eq!(run(&[], &["a", "b"]), ("ab".into(), false));
    }
}
