//! Stop strings over generated text, one matcher for the decoder (which ends a generation at the
//! token that completes a stop string) and the gateway (which shows clients the text before it,
//! OpenAI's semantics). Both run [`StopText`] over the same deltas, so they agree on where a
//! generation stopped by construction.

/// Client-visible text with OpenAI's stop-string semantics: the stop string and everything after
/// it are not shown. Text that could still become a stop string is held back until it cannot;
/// the decoder has committed the tokens that contain the stop string (it stops after them), so
/// only the text is cut, never the records. A pure function of the text so far, so every
/// gateway cuts the same way.
#[derive(Clone, Debug)]
pub struct StopText {
    stops: Vec<String>,
    /// Text not shown yet: the longest tail that is the start of some stop string.
    held: String,
    /// The index (in the list as given) of the stop string that ended the text, once one has.
    hit: Option<usize>,
}

impl StopText {
    /// Empty stop strings never match.
    pub fn new(stops: Vec<String>) -> Self {
        StopText {
            stops,
            held: String::new(),
            hit: None,
        }
    }

    /// The stop string that ended the text: the lowest index (in the list given to
    /// [`StopText::new`]) among those the text contains once it stopped (the finish detail the
    /// decoder records). The text is cut where the earliest of them starts.
    pub fn hit(&self) -> Option<usize> {
        self.hit
    }

    /// The text that can be shown after `delta`.
    pub fn push(&mut self, delta: &str) -> String {
        if self.hit.is_some() {
            return String::new();
        }
        if self.stops.iter().all(String::is_empty) {
            return delta.to_string();
        }
        self.held.push_str(delta);
        let found: Vec<(usize, usize)> = self
            .stops
            .iter()
            .enumerate()
            .filter(|(_, s)| !s.is_empty())
            .filter_map(|(i, s)| self.held.find(s.as_str()).map(|pos| (i, pos)))
            .collect();
        if let (Some(&(lowest, _)), Some(pos)) = (found.first(), found.iter().map(|&(_, p)| p).min()) {
            self.hit = Some(lowest);
            let out = self.held[..pos].to_string();
            self.held.clear();
            return out;
        }
        // Keep the longest tail of `held` that is the start of some stop string.
        let keep = self
            .stops
            .iter()
            .filter(|s| !s.is_empty())
            .flat_map(|s| {
                s.char_indices()
                    .skip(1)
                    .map(|(i, _)| &s[..i])
                    .chain(std::iter::once(s.as_str()))
            })
            .filter(|p| self.held.ends_with(p))
            .map(str::len)
            .max()
            .unwrap_or(0);
        let cut = self.held.len() - keep;
        let out = self.held[..cut].to_string();
        self.held.drain(..cut);
        out
    }

    /// The rest at the end of the generation (held-back text that never became a stop string).
    pub fn finish(&mut self, delta: &str) -> String {
        let mut out = self.push(delta);
        if self.hit.is_none() {
            out.push_str(&std::mem::take(&mut self.held));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::StopText;

    fn run(stops: &[&str], deltas: &[&str]) -> (Vec<String>, String) {
        let mut s = StopText::new(stops.iter().map(|x| x.to_string()).collect());
        let (last, body) = deltas.split_last().unwrap();
        let shown: Vec<String> = body.iter().map(|d| s.push(d)).collect();
        (shown, s.finish(last))
    }

    #[test]
    fn stop_string_and_what_follows_are_cut() {
        let (shown, rest) = run(&["END"], &["hello ", "wor", "ld E", "N", "D and more", ""]);
        assert_eq!(shown.concat() + &rest, "hello world ");
        // "E" and "N" were held back while they could still become "END".
        assert_eq!(shown, vec!["hello ", "wor", "ld ", "", ""]);
    }

    #[test]
    fn held_text_is_released_when_it_cannot_become_a_stop_string() {
        let (shown, rest) = run(&["END"], &["an E", "NOUGH", " text", ""]);
        assert_eq!(shown.concat() + &rest, "an ENOUGH text");
        let (shown, rest) = run(&["END"], &["the E"]);
        assert!(shown.is_empty());
        assert_eq!(
            rest, "the E",
            "a generation that ends for another reason shows everything"
        );
    }

    #[test]
    fn earliest_of_several_stop_strings_wins_and_no_stops_is_identity() {
        let mut s = StopText::new(vec!["xyz".into(), "b".into()]);
        let shown = s.push("aab") + &s.push("cxyz") + &s.finish("");
        assert_eq!(shown, "aa");
        assert_eq!(s.hit(), Some(1));
        // Cut at the earliest stop string; the hit names the lowest index found (the decoder's
        // finish detail, as before the matcher was shared).
        let mut s = StopText::new(vec!["d".into(), "cd".into()]);
        let shown = s.push("ab c") + &s.push("d!") + &s.finish("");
        assert_eq!((shown.as_str(), s.hit()), ("ab ", Some(0)));
        let (shown, rest) = run(&[], &["a", "b", "c"]);
        assert_eq!(shown.concat() + &rest, "abc");
    }
}
