//! `${VAR}` interpolation of the raw config text, before it is parsed as
//! TOML (the way Vector and docker-compose do it).
//!
//! Syntax:
//! - `${NAME}`: the value of environment variable `NAME`; an error naming the
//!   variable and the line when it is not set (set but empty gives "").
//! - `${NAME:-default}`: `default` when `NAME` is unset or empty. The default
//!   is the text up to the first `}` on the same line, with `$$` read as `$`
//!   (no nested `${...}`).
//! - `$$`: a literal `$`.
//! - a `$` followed by anything else is left as it is.
//!
//! `NAME` is `[A-Za-z_][A-Za-z0-9_]*`. Comments (`# ...` outside strings) are
//! not interpolated, so a commented-out line may mention a variable that is
//! not set.
//!
//! Values are inserted **verbatim**: they are not escaped for TOML. A value
//! with a `"`, a `\` or a newline can therefore end the string it was meant to
//! be part of and break (or, in the worst case, add to) the TOML around it.
//! Put values where they belong (`url = "${APP_URL}"`); parse errors on a line
//! that had a value inserted name the variable so such a value is found
//! quickly. Besides, unknown keys are rejected and every value is validated.
//!
//! Owns: the interpolation and the map from positions in the interpolated
//! text back to lines of the file as written.

use std::ops::Range;

/// The text after interpolation, with what is needed to map a position in it
/// back to the file as written.
#[derive(Debug)]
pub(super) struct Interpolated {
    /// The interpolated text, to be parsed as TOML.
    pub(super) text: String,
    /// Every `${...}` replaced, in order.
    substitutions: Vec<Substitution>,
    /// `(offset in text, offset in source)` pairs, sorted, from which on the
    /// two texts are identical until the next substitution.
    anchors: Vec<(usize, usize)>,
}

/// One `${...}` that was replaced.
#[derive(Debug)]
struct Substitution {
    variable: String,
    /// Where the value is in the interpolated text.
    out: Range<usize>,
    /// Offset of the `$` in the source.
    src: usize,
    /// Line (1-based) of the `$` in the source.
    line: usize,
}

/// Why interpolation failed.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct InterpolationError {
    /// 1-based line of the source.
    pub(super) line: usize,
    /// The variable's name as written (may be malformed).
    pub(super) variable: String,
    /// What is wrong, as a sentence fragment naming the variable.
    pub(super) problem: String,
}

/// Where the lexer is in the TOML source: only comments are skipped, but
/// a `#` starts a comment only outside strings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    Normal,
    Comment,
    Basic,
    MultiBasic,
    Literal,
    MultiLiteral,
}

/// Interpolates `${VAR}`, `${VAR:-default}` and `$$` in `src`, reading
/// variables through `env`.
pub(super) fn interpolate(
    src: &str,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<Interpolated, InterpolationError> {
    let bytes = src.as_bytes();
    let mut out = String::with_capacity(src.len());
    let mut substitutions = Vec::new();
    let mut anchors = vec![(0, 0)];
    let mut state = State::Normal;
    let mut line = 1;
    // Source bytes from `copied` up to `i` are still to be copied verbatim.
    let mut copied = 0;
    let mut i = 0;
    let starts = |i: usize, pat: &[u8]| bytes.get(i..).is_some_and(|rest| rest.starts_with(pat));

    while let Some(&b) = bytes.get(i) {
        if b == b'\n' {
            line += 1;
        }
        if state == State::Comment {
            if b == b'\n' {
                state = State::Normal;
            }
            i += 1;
            continue;
        }
        if b == b'$' {
            match bytes.get(i + 1) {
                Some(b'$') => {
                    out.push_str(&src[copied..i]);
                    out.push('$');
                    i += 2;
                    copied = i;
                    anchors.push((out.len(), i));
                    continue;
                }
                Some(b'{') => {
                    out.push_str(&src[copied..i]);
                    let (end, variable, value) = substitute(src, i, line, env)?;
                    let start = out.len();
                    out.push_str(&value);
                    substitutions.push(Substitution {
                        variable,
                        out: start..out.len(),
                        src: i,
                        line,
                    });
                    i = end;
                    copied = i;
                    anchors.push((out.len(), i));
                    continue;
                }
                _ => {}
            }
        }
        match state {
            State::Normal => match b {
                b'#' => state = State::Comment,
                b'"' if starts(i, b"\"\"\"") => {
                    state = State::MultiBasic;
                    i += 3;
                    continue;
                }
                b'"' => state = State::Basic,
                b'\'' if starts(i, b"'''") => {
                    state = State::MultiLiteral;
                    i += 3;
                    continue;
                }
                b'\'' => state = State::Literal,
                _ => {}
            },
            State::Basic | State::MultiBasic
                if b == b'\\' && matches!(bytes.get(i + 1), Some(b'"' | b'\\')) =>
            {
                i += 2;
                continue;
            }
            State::Basic if matches!(b, b'"' | b'\n') => state = State::Normal,
            State::Literal if matches!(b, b'\'' | b'\n') => state = State::Normal,
            State::MultiBasic if starts(i, b"\"\"\"") => {
                i = close_multiline(bytes, i, b'"');
                state = State::Normal;
                continue;
            }
            State::MultiLiteral if starts(i, b"'''") => {
                i = close_multiline(bytes, i, b'\'');
                state = State::Normal;
                continue;
            }
            _ => {}
        }
        i += 1;
    }
    out.push_str(&src[copied..]);
    Ok(Interpolated {
        text: out,
        substitutions,
        anchors,
    })
}

/// Index just past the delimiter that closes a multi-line string at `i`:
/// three quotes, plus up to two more that belong to the content
/// (`"""a"""""` is `a""`).
fn close_multiline(bytes: &[u8], i: usize, quote: u8) -> usize {
    let mut end = i + 3;
    while end < i + 5 && bytes.get(end) == Some(&quote) {
        end += 1;
    }
    end
}

/// Replaces the `${...}` starting at `start` (the `$`). Returns the index
/// just past the closing `}`, the variable's name and its value.
fn substitute(
    src: &str,
    start: usize,
    line: usize,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<(usize, String, String), InterpolationError> {
    let rest = &src[start + 2..];
    let line_rest = rest.split('\n').next().unwrap_or_default();
    let Some(close) = line_rest.find('}') else {
        let shown: String = line_rest.chars().take(40).collect();
        return Err(InterpolationError {
            line,
            variable: shown.clone(),
            problem: format!(
                "`${{{shown}` is not closed by a `}}` on this line (write `$${{` for a literal `${{`)"
            ),
        });
    };
    let inner = &line_rest[..close];
    let (name, default) = match inner.split_once(":-") {
        Some((name, default)) => (name, Some(default)),
        None => (inner, None),
    };
    if !is_variable_name(name) {
        return Err(InterpolationError {
            line,
            variable: name.to_string(),
            problem: format!(
                "`${{{inner}}}` is not an interpolation this config understands: write \
                 `${{NAME}}` or `${{NAME:-default}}` with NAME made of letters, digits and `_`, \
                 or `$$` for a literal `$`"
            ),
        });
    }
    let value = match (env(name), default) {
        (Some(value), Some(default)) if value.is_empty() => default.replace("$$", "$"),
        (Some(value), _) => value,
        (None, Some(default)) => default.replace("$$", "$"),
        (None, None) => {
            return Err(InterpolationError {
                line,
                variable: name.to_string(),
                problem: format!(
                    "environment variable `{name}` is not set (or write `${{{name}:-default}}`)"
                ),
            });
        }
    };
    Ok((start + 2 + close + 1, name.to_string(), value))
}

/// `[A-Za-z_][A-Za-z0-9_]*`.
fn is_variable_name(name: &str) -> bool {
    let mut chars = name.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

impl Interpolated {
    /// The offset in the source that produced the byte at `out` of the
    /// interpolated text (the `$` of a `${...}` for a byte of its value).
    pub(super) fn source_offset(&self, out: usize) -> usize {
        if let Some(sub) = self.substitutions.iter().find(|s| s.out.contains(&out)) {
            return sub.src;
        }
        let after = self.anchors.partition_point(|&(o, _)| o <= out);
        let (o, s) = after
            .checked_sub(1)
            .and_then(|k| self.anchors.get(k))
            .copied()
            .unwrap_or((0, 0));
        s + (out - o)
    }

    /// Names of the variables inserted on `line` (1-based) of the source,
    /// without repetitions.
    pub(super) fn variables_on_line(&self, line: usize) -> Vec<String> {
        let mut names: Vec<String> = Vec::new();
        for sub in self.substitutions.iter().filter(|s| s.line == line) {
            if !names.contains(&sub.variable) {
                names.push(sub.variable.clone());
            }
        }
        names
    }
}

/// 1-based line and column (in characters) of byte `offset` of `src`.
pub(super) fn line_and_column(src: &str, offset: usize) -> (usize, usize) {
    let offset = src.floor_char_boundary(offset.min(src.len()));
    let before = &src[..offset];
    let line = before.matches('\n').count() + 1;
    let line_start = before.rfind('\n').map_or(0, |n| n + 1);
    (line, before[line_start..].chars().count() + 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(name: &str) -> Option<String> {
        match name {
            "APP_URL" => Some("http://127.0.0.1:8080/calls".into()),
            "EMPTY" => Some(String::new()),
            "QUOTE" => Some("a\"b".into()),
            "MULTI" => Some("x\ny".into()),
            _ => None,
        }
    }

    fn run(src: &str) -> Result<String, InterpolationError> {
        interpolate(src, &env).map(|i| i.text)
    }

    #[test]
    fn replaces_set_variables() {
        assert_eq!(
            run("url = \"${APP_URL}\"\n").unwrap(),
            "url = \"http://127.0.0.1:8080/calls\"\n"
        );
        assert_eq!(run("a = \"${EMPTY}\"").unwrap(), "a = \"\"");
        assert_eq!(
            run("a = '${APP_URL}'").unwrap(),
            "a = 'http://127.0.0.1:8080/calls'"
        );
        assert_eq!(run("n = ${NOPE:-64}").unwrap(), "n = 64");
    }

    #[test]
    fn unset_variable_names_it_and_the_line() {
        let err = run("a = 1\n\n# ${IN_COMMENT}\nurl = \"${MISSING_URL}\"\n").unwrap_err();
        assert_eq!(err.line, 4);
        assert_eq!(err.variable, "MISSING_URL");
        assert!(
            err.problem.contains("`MISSING_URL` is not set"),
            "{}",
            err.problem
        );
    }

    #[test]
    fn default_applies_when_unset_or_empty() {
        assert_eq!(run("${NOPE:-d}").unwrap(), "d");
        assert_eq!(run("${EMPTY:-d}").unwrap(), "d");
        assert_eq!(run("${APP_URL:-d}").unwrap(), "http://127.0.0.1:8080/calls");
        assert_eq!(run("${NOPE:-}").unwrap(), "");
        assert_eq!(run("${NOPE:-127.0.0.1:9464}").unwrap(), "127.0.0.1:9464");
        assert_eq!(run("${NOPE:-a#b\"c}").unwrap(), "a#b\"c");
        assert_eq!(run("${NOPE:-a$$b$c}").unwrap(), "a$b$c");
    }

    #[test]
    fn dollar_escapes_and_lone_dollars() {
        assert_eq!(run("a = \"$${APP_URL}\"").unwrap(), "a = \"${APP_URL}\"");
        assert_eq!(run("a = \"$$\"").unwrap(), "a = \"$\"");
        assert_eq!(run("a = \"$$$$\"").unwrap(), "a = \"$$\"");
        assert_eq!(run("a = \"$HOME $ 5$\"").unwrap(), "a = \"$HOME $ 5$\"");
        assert_eq!(run("a = \"$").unwrap(), "a = \"$");
    }

    #[test]
    fn comments_are_left_alone() {
        let src = "# needs ${NOT_SET} and $$\na = \"#${APP_URL}\" # ${ALSO_NOT_SET}\n";
        assert_eq!(
            run(src).unwrap(),
            "# needs ${NOT_SET} and $$\na = \"#http://127.0.0.1:8080/calls\" # ${ALSO_NOT_SET}\n"
        );
        // A `#` inside any kind of string is not a comment.
        for quoted in ["'#'", "\"#\"", "\"\"\"#\n\"\"\"", "'''#\n'''", "\"\\\"#\""] {
            let src = format!("a = {quoted} ${{APP_URL}}");
            assert!(
                run(&src).unwrap().ends_with("http://127.0.0.1:8080/calls"),
                "{src}"
            );
        }
        // Multi-line strings may end with extra quotes.
        assert!(
            run("a = \"\"\"x\"\"\"\"\" ${APP_URL}")
                .unwrap()
                .ends_with("/calls")
        );
    }

    #[test]
    fn malformed_interpolations_are_errors() {
        let err = run("a = 1\nb = \"${APP_URL\"\n").unwrap_err();
        assert_eq!(err.line, 2);
        assert!(err.problem.contains("not closed"), "{}", err.problem);
        let err = run("b = \"${1X}\"").unwrap_err();
        assert!(err.problem.contains("`${1X}`"), "{}", err.problem);
        let err = run("b = \"${X:?message}\"").unwrap_err();
        assert!(err.problem.contains("NAME:-default"), "{}", err.problem);
        let err = run("b = \"${}\"").unwrap_err();
        assert!(err.problem.contains("`${}`"), "{}", err.problem);
    }

    #[test]
    fn maps_positions_back_to_the_source() {
        let src = "a = \"${MULTI}\"\nb = \"$$\"\nc = 1\n";
        let i = interpolate(src, &env).unwrap();
        assert_eq!(i.text, "a = \"x\ny\"\nb = \"$\"\nc = 1\n");
        let pos = |needle: &str| i.text.find(needle).unwrap();
        // Inside the value: the `${`.
        assert_eq!(line_and_column(src, i.source_offset(pos("y"))), (1, 6));
        // After the value, on the same source line.
        assert_eq!(line_and_column(src, i.source_offset(pos("\"\nb"))), (1, 14));
        assert_eq!(line_and_column(src, i.source_offset(pos("c ="))), (3, 1));
        assert_eq!(line_and_column(src, i.source_offset(pos("$"))), (2, 6));
        assert_eq!(i.variables_on_line(1), vec!["MULTI".to_string()]);
        assert!(i.variables_on_line(2).is_empty());
    }

    #[test]
    fn values_are_inserted_verbatim() {
        assert_eq!(run("a = \"${QUOTE}\"").unwrap(), "a = \"a\"b\"");
    }

    #[test]
    fn multibyte_text_is_copied_intact() {
        assert_eq!(
            run("a = \"héllo ${NOPE:-wörld} ✓\"").unwrap(),
            "a = \"héllo wörld ✓\""
        );
        assert_eq!(line_and_column("é\néa", 5), (2, 2));
        // Inside a character: that character.
        assert_eq!(line_and_column("é\néa", 4), (2, 1));
    }
}
