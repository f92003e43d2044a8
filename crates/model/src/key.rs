//! A window's key as output rows carry it: the values of the job's key columns joined
//! with `|`, each `|` or `\` inside a value escaped with `\`, so ("a|b", "c") and
//! ("a", "b|c") stay different keys. A key of one column is its value as it is. The
//! engine writes keys this way; [`key_parts`] reads one back.

/// The values of a key of `columns` columns, in key-column order: a key of one column is
/// its value as it is (the engine does not escape it), others are split.
pub fn key_parts(key: &str, columns: usize) -> Vec<String> {
    if columns == 1 {
        vec![key.to_string()]
    } else {
        split_key(key)
    }
}

/// The values of a joined key of two or more columns, in key-column order (a key of one
/// column is read with [`key_parts`]).
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

/// `values` joined as a key of that many columns (the inverse of [`key_parts`]): one
/// value is the key as it is.
pub fn join_key<S: AsRef<str>>(values: &[S]) -> String {
    if let [one] = values {
        return one.as_ref().to_string();
    }
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
            vec!["o|ne\\"],
        ] {
            let key = join_key(&values);
            assert_eq!(key_parts(&key, values.len()), values, "{key}");
        }
        // One column's value is its key, as the engine writes it.
        assert_eq!(join_key(&["a|b"]), "a|b");
        assert_ne!(join_key(&["a|b", "c"]), join_key(&["a", "b|c"]));
    }
}
