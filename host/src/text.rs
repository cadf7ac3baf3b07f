//! Text the relay passes on from others (plugin log lines, dead-letter
//! reasons), kept to a bounded size.

use std::borrow::Cow;

/// `text` cut to at most `max` bytes at a character boundary, saying how
/// many bytes were cut; as it is when it fits.
pub fn cut_to(text: &str, max: usize) -> Cow<'_, str> {
    if text.len() <= max {
        return text.into();
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}… ({} bytes cut)", &text[..end], text.len() - end).into()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_long_text_is_cut_at_a_character_boundary_saying_how_much_went() {
        let text = "é".repeat(100);
        let cut = cut_to(&text, 51);
        assert_eq!(cut, format!("{}… (150 bytes cut)", "é".repeat(25)));
        assert_eq!(cut_to("short", 51), "short");
    }
}
