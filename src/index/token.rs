//! Opaque strings the apiserver hands out (a UID, a resourceVersion), kept in the fewest bytes
//! that print back exactly. The cache holds two per Deployment: as boxed strings they were two
//! allocations and ~60 bytes; a UUID fits in 16 bytes and etcd's revision in 8, inline.

use std::fmt;

#[derive(Clone, PartialEq, Eq)]
pub enum Token {
    /// A lowercase, hyphenated UUID (what the apiserver generates for UIDs).
    Uuid([u8; 16]),
    /// A decimal without leading zeros (etcd's revision, the usual resourceVersion).
    Number(u64),
    /// Anything else, as given.
    Text(Box<str>),
}

impl Token {
    fn uuid(text: &str) -> Option<[u8; 16]> {
        let bytes = text.as_bytes();
        if bytes.len() != 36 || [8, 13, 18, 23].iter().any(|&i| bytes[i] != b'-') {
            return None;
        }
        let mut digits = bytes.iter().filter(|&&b| b != b'-');
        let mut uuid = [0u8; 16];
        for byte in &mut uuid {
            let high = lower_hex(*digits.next()?)?;
            let low = lower_hex(*digits.next()?)?;
            *byte = high << 4 | low;
        }
        Some(uuid)
    }

    fn number(text: &str) -> Option<u64> {
        let canonical = !text.is_empty()
            && text.bytes().all(|b| b.is_ascii_digit())
            && (text == "0" || !text.starts_with('0'));
        canonical.then(|| text.parse().ok()).flatten()
    }
}

/// A lowercase hex digit's value; uppercase would not print back the same.
fn lower_hex(digit: u8) -> Option<u8> {
    match digit {
        b'0'..=b'9' => Some(digit - b'0'),
        b'a'..=b'f' => Some(digit - b'a' + 10),
        _ => None,
    }
}

impl From<&str> for Token {
    fn from(text: &str) -> Self {
        if let Some(uuid) = Token::uuid(text) {
            Token::Uuid(uuid)
        } else if let Some(number) = Token::number(text) {
            Token::Number(number)
        } else {
            Token::Text(text.into())
        }
    }
}

impl fmt::Display for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Token::Uuid(uuid) => {
                for (i, byte) in uuid.iter().enumerate() {
                    if matches!(i, 4 | 6 | 8 | 10) {
                        f.write_str("-")?;
                    }
                    write!(f, "{byte:02x}")?;
                }
                Ok(())
            }
            Token::Number(number) => write!(f, "{number}"),
            Token::Text(text) => f.write_str(text),
        }
    }
}

impl fmt::Debug for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", self.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_token_prints_back_exactly_and_the_usual_ones_are_inline() {
        let cases = [
            ("0b7e6f0c-3d2a-4c55-9a51-00000000002a", "uuid"),
            ("ffffffff-ffff-ffff-ffff-ffffffffffff", "uuid"),
            ("0B7E6F0C-3D2A-4C55-9A51-00000000002A", "text"),
            ("0b7e6f0c3d2a-4c55-9a51-00000000002a-", "text"),
            ("0b7e6f0c-3d2a-4c55-9a51-00000000002", "text"),
            ("0b7e6f0c-3d2a-4c55-9a51-00000000002g", "text"),
            ("123456", "number"),
            ("0", "number"),
            ("18446744073709551615", "number"),
            ("18446744073709551616", "text"),
            ("007", "text"),
            ("-1", "text"),
            ("+1", "text"),
            ("", "text"),
            ("uid-1", "text"),
        ];
        for (text, kind) in cases {
            let token = Token::from(text);
            assert_eq!(token.to_string(), text, "{text}");
            let got = match token {
                Token::Uuid(_) => "uuid",
                Token::Number(_) => "number",
                Token::Text(_) => "text",
            };
            assert_eq!(got, kind, "{text}");
        }
        assert!(std::mem::size_of::<Token>() <= 24);
    }
}
