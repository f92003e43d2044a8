//! A window's key as output rows carry it: the values of the job's key columns joined
//! with `|`, each `|` or `\` inside a value escaped with `\`, so ("a|b", "c") and
//! ("a", "b|c") stay different keys. The engine writes keys this way; [`split_key`]
//! reads one back.

/// The values of a joined key, in key-column order. A key of one column is its value
/// unescaped.
pub fn split_key(key: &str) -> Vec<String> {
    let mut parts = vec![String::new()];
    let mut chars = key.chars();
    while let Some(ch) = chars.next() {
        match ch {
            '\\' => {
                if let Some(escaped) = chars.next() {
                    parts.last_mut().expect("never empty").push(escaped);
                }
            }
            '|' => parts.push(String::new()),
            ch => parts.last_mut().expect("never empty").push(ch),
        }
    }
    parts
}

/// `values` joined as a key of that many columns (the inverse of [`split_key`]).
pub fn join_key<S: AsRef<str>>(values: &[S]) -> String {
    let mut out = String::new();
    for (i, v) in values.iter().enumerate() {
        if i > 0 {
            out.push('|');
        }
        for ch in v.as_ref().chars() {
            if ch == '|' || ch == '\\' {
                out.push('\\');
            }
            out.push(ch);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_joined_key_splits_into_its_values() {
        for values in [
            vec!["tenant-0", "c-7"],
            vec!["a|b", "c"],
            vec!["a", "b|c"],
            vec!["x\\", "|y\\|"],
            vec!["", ""],
            vec!["one"],
        ] {
            let key = join_key(&values);
            assert_eq!(split_key(&key), values, "{key}");
        }
        assert_ne!(join_key(&["a|b", "c"]), join_key(&["a", "b|c"]));
    }
}
