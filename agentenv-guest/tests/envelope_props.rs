//! Property tests of the Connect envelope codec the agent reads requests with:
//! no input makes it panic, and whatever it encodes it decodes again, however
//! the bytes are split.

use agentenv_guest::connect::envelope::{
    EnvelopeDecoder, decode_envelopes, encode_envelope, parse_end_stream,
};
use proptest::prelude::*;

proptest! {
    #[test]
    fn decoding_any_bytes_never_panics(body in proptest::collection::vec(any::<u8>(), 0..256), max in 0usize..64) {
        let _ = decode_envelopes(&body, max);
        let _ = parse_end_stream(&body);
    }

    #[test]
    fn encoded_envelopes_decode_to_the_same_messages_however_split(
        msgs in proptest::collection::vec((any::<u8>(), proptest::collection::vec(any::<u8>(), 0..48)), 0..5),
        cuts in proptest::collection::vec(any::<prop::sample::Index>(), 0..5),
    ) {
        let mut wire = Vec::new();
        for (flags, payload) in &msgs {
            wire.extend_from_slice(&encode_envelope(*flags, payload));
        }
        let mut points: Vec<usize> = cuts.iter().map(|c| c.index(wire.len() + 1)).collect();
        points.sort_unstable();
        points.push(wire.len());
        let mut dec = EnvelopeDecoder::new(64);
        let mut got = Vec::new();
        let mut at = 0;
        for p in points {
            dec.push(&wire[at..p]);
            at = p;
            while let Some(env) = dec.next_envelope().unwrap() {
                got.push((env.flags, env.payload.to_vec()));
            }
        }
        dec.finish().unwrap();
        prop_assert_eq!(got, msgs);
    }

    #[test]
    fn a_declared_length_over_the_limit_is_refused_before_it_is_buffered(len in 65u32..u32::MAX) {
        let mut head = vec![0u8];
        head.extend_from_slice(&len.to_be_bytes());
        let mut dec = EnvelopeDecoder::new(64);
        dec.push(&head);
        prop_assert!(dec.next_envelope().is_err());
    }
}
