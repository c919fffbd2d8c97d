//! Stop strings on streamed text. Text is released only when no stop string can still begin
//! inside it, so a client never sees a partial stop string; on a match the text is cut just
//! before the stop string.

/// Incremental matcher over decoded text.
#[derive(Clone, Debug, Default)]
pub struct StopMatcher {
    stops: Vec<String>,
    /// Text decoded but not yet released.
    pending: String,
}

/// What one push produced.
#[derive(Debug, PartialEq, Eq)]
pub enum StopCheck {
    /// Text safe to release now; no stop string seen.
    Continue(String),
    /// A stop string matched; the text before it (still unreleased) is given.
    Stopped(String),
}

impl StopMatcher {
    pub fn new(stops: Vec<String>) -> Self {
        StopMatcher { stops: stops.into_iter().filter(|s| !s.is_empty()).collect(), pending: String::new() }
    }

    pub fn push(&mut self, text: &str) -> StopCheck {
        self.pending.push_str(text);
        if self.stops.is_empty() {
            return StopCheck::Continue(std::mem::take(&mut self.pending));
        }
        // Earliest complete match.
        if let Some(pos) = self.stops.iter().filter_map(|s| self.pending.find(s.as_str())).min() {
            let out = self.pending[..pos].to_string();
            self.pending.clear();
            return StopCheck::Stopped(out);
        }
        // Hold back the longest suffix that is a proper prefix of some stop string.
        let mut hold = 0;
        for s in &self.stops {
            for (i, _) in s.char_indices().skip(1) {
                if self.pending.ends_with(&s[..i]) {
                    hold = hold.max(i);
                }
            }
        }
        let cut = self.pending.len() - hold;
        let out = self.pending[..cut].to_string();
        self.pending.drain(..cut);
        StopCheck::Continue(out)
    }

    /// Releases whatever is held back (end of generation without a match).
    pub fn flush(&mut self) -> String {
        std::mem::take(&mut self.pending)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn holds_partial_and_cuts_at_match() {
        let mut m = StopMatcher::new(vec!["END".into()]);
        assert_eq!(m.push("hello E"), StopCheck::Continue("hello ".into()));
        assert_eq!(m.push("N"), StopCheck::Continue("".into()));
        assert_eq!(m.push("Dx"), StopCheck::Stopped("".into()));
        let mut m = StopMatcher::new(vec!["END".into()]);
        assert_eq!(m.push("aEb"), StopCheck::Continue("aEb".into()));
        assert_eq!(m.push("cEN"), StopCheck::Continue("c".into()));
        assert_eq!(m.flush(), "EN");
        let mut m = StopMatcher::new(vec!["ab".into(), "b".into()]);
        assert_eq!(m.push("xab"), StopCheck::Stopped("x".into()));
    }
}
