//! [`Strs`]: a string column as the engine reads it, plain (`Utf8`) or dictionary-encoded
//! (`Dictionary(Int32, Utf8)`).
//!
//! A backfill reads low-cardinality columns (event type, market, tenant) as dictionaries,
//! as they are stored: materialising them as plain strings was a tenth of a backfill's
//! time, and a dictionary lets the engine resolve an event type or hash a key once per
//! distinct value instead of once per record. Values are the same whichever the encoding,
//! so are identities, keys and outputs.

use arrow::array::{Array, AsArray, DictionaryArray, PrimitiveArray, StringArray};
use arrow::datatypes::{DataType, Int32Type};

/// A string column: plain, or dictionary keys into plain values.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Strs<'a> {
    Plain(&'a StringArray),
    Dict {
        keys: &'a PrimitiveArray<Int32Type>,
        values: &'a StringArray,
    },
}

impl<'a> Strs<'a> {
    /// `array` as a string column, or None for any other type.
    pub(crate) fn of(array: &'a dyn Array) -> Option<Self> {
        match array.data_type() {
            DataType::Utf8 => Some(Self::Plain(array.as_string::<i32>())),
            DataType::Dictionary(k, v) if **k == DataType::Int32 && **v == DataType::Utf8 => {
                let dict: &DictionaryArray<Int32Type> = array.as_dictionary();
                Some(Self::Dict {
                    keys: dict.keys(),
                    values: dict.values().as_string::<i32>(),
                })
            }
            _ => None,
        }
    }

    /// Whether `row` is null (a null key, or a key to a null value).
    #[inline]
    pub(crate) fn is_null(&self, row: usize) -> bool {
        match self {
            Self::Plain(a) => a.is_null(row),
            Self::Dict { keys, values } => {
                keys.is_null(row) || values.is_null(keys.values()[row] as usize)
            }
        }
    }

    /// The value of a non-null `row`.
    #[inline]
    pub(crate) fn value(&self, row: usize) -> &'a str {
        match self {
            Self::Plain(a) => a.value(row),
            Self::Dict { keys, values } => values.value(keys.values()[row] as usize),
        }
    }

    /// The dictionary value index of `row` (None when plain). The index of a null row is
    /// meaningless, and may be out of range.
    #[inline]
    pub(crate) fn code(&self, row: usize) -> Option<usize> {
        match self {
            Self::Plain(_) => None,
            Self::Dict { keys, .. } => Some(keys.values()[row] as usize),
        }
    }

    /// The dictionary's values (None when plain).
    pub(crate) fn values(&self) -> Option<&'a StringArray> {
        match self {
            Self::Plain(_) => None,
            Self::Dict { values, .. } => Some(values),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::Int32Array;
    use std::sync::Arc;

    #[test]
    fn a_dictionary_reads_as_its_plain_column() {
        let plain = StringArray::from(vec![Some("b"), None, Some("a"), Some("b"), Some("c")]);
        let values = StringArray::from(vec![Some("a"), Some("b"), None]);
        // Row 4 points at a null value: null, as a null key is.
        let keys = Int32Array::from(vec![Some(1), None, Some(0), Some(1), Some(2)]);
        let dict = DictionaryArray::<Int32Type>::try_new(keys, Arc::new(values)).unwrap();
        let (p, d) = (Strs::of(&plain).unwrap(), Strs::of(&dict).unwrap());
        for row in 0..4 {
            assert_eq!(p.is_null(row), d.is_null(row), "row {row}");
            if !p.is_null(row) {
                assert_eq!(p.value(row), d.value(row));
            }
        }
        assert!(d.is_null(4));
        assert_eq!(d.code(3), Some(1));
        assert_eq!(p.code(3), None);
        assert!(Strs::of(&Int32Array::from(vec![1])).is_none());
    }
}
