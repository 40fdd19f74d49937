//! The three queues of a hostile driver against the vsock muxer, with host sockets on the
//! other side: whatever the descriptors say, the device writes packets only into receive
//! and event chains that hold them, reports their exact lengths, and writes nothing else.

use std::io::Write;
use std::os::unix::net::{UnixListener, UnixStream};

use proptest::collection::vec;
use proptest::prelude::*;

use super::*;
use crate::devices::virtio::hostile::{self, BufGen, ByteSet, ChainGen, Snapshot};

const CID: u64 = 3;
/// The host port a host process listens on for the guest (`<uds_path>_5000`).
const LISTENED_PORT: u32 = 5000;
/// The guest port a host process asks for (`CONNECT 52`).
const GUEST_PORT: u32 = 52;

/// A packet header, mostly one this device could take.
fn packet() -> impl Strategy<Value = Header> {
    (
        (
            prop_oneof![8 => Just(CID), 1 => any::<u64>()],
            prop_oneof![8 => Just(HOST_CID), 1 => any::<u64>()],
            prop_oneof![4 => 1000u32..1004, 2 => Just(GUEST_PORT), 1 => any::<u32>()],
            prop_oneof![
                4 => Just(LISTENED_PORT),
                2 => Just(FIRST_LOCAL_PORT),
                1 => Just(LISTENED_PORT + 1),
                1 => any::<u32>(),
            ],
            prop_oneof![4 => 0u32..64, 1 => Just(MAX_PKT_DATA as u32), 1 => any::<u32>()],
        ),
        (
            prop_oneof![8 => Just(TYPE_STREAM), 1 => any::<u16>()],
            prop_oneof![8 => OP_REQUEST..=OP_CREDIT_REQUEST, 1 => any::<u16>()],
            prop_oneof![3 => 0u32..4, 1 => any::<u32>()],
            prop_oneof![Just(0u32), Just(4096), Just(CONN_BUF_ALLOC), Just(u32::MAX)],
            any::<u32>(),
        ),
    )
        .prop_map(
            |(
                (src_cid, dst_cid, src_port, dst_port, len),
                (type_, op, flags, buf_alloc, fwd_cnt),
            )| {
                Header {
                    src_cid,
                    dst_cid,
                    src_port,
                    dst_port,
                    len,
                    type_,
                    op,
                    flags,
                    buf_alloc,
                    fwd_cnt,
                }
            },
        )
}

/// Mostly packets: a readable header (written where the test may), then payload.
fn tx_chain() -> BoxedStrategy<ChainGen> {
    let bufs = packet().prop_flat_map(|h| {
        let header_len = prop_oneof![6 => Just(HDR_LEN as u32), 1 => hostile::any_len()];
        let header =
            hostile::buf(hostile::pinned_addr(), header_len.boxed(), 0.05).prop_map(move |b| {
                BufGen {
                    content: h.to_bytes().to_vec(),
                    ..b
                }
            });
        let data_len = prop_oneof![4 => Just(h.len), 1 => 0u32..100, 1 => hostile::any_len()];
        let data = hostile::buf(hostile::data_addr(), data_len.boxed(), 0.1);
        let payloads = usize::from(h.len > 0)..=2;
        (header, vec(data, payloads)).prop_map(|(h, data)| {
            let mut bufs = vec![h];
            bufs.extend(data);
            bufs
        })
    });
    hostile::mostly_plain(bufs.boxed(), 0.2)
}

fn rx_chain() -> BoxedStrategy<ChainGen> {
    let len = prop_oneof![
        2 => Just(HDR_LEN as u32 + 4096),
        1 => Just(HDR_LEN as u32),
        1 => 0u32..200,
        1 => hostile::any_len(),
    ];
    let bufs = vec(hostile::buf(hostile::data_addr(), len.boxed(), 0.95), 1..=3);
    hostile::mostly_plain(bufs.boxed(), 0.9)
}

fn event_chain() -> BoxedStrategy<ChainGen> {
    let len = prop_oneof![2 => Just(4u32), 1 => 0u32..8, 1 => hostile::any_len()];
    let bufs = vec(hostile::buf(hostile::data_addr(), len.boxed(), 0.9), 1..=2);
    hostile::mostly_plain(bufs.boxed(), 0.9)
}

proptest! {
    #![proptest_config(hostile::config())]

    #[test]
    fn vsock_writes_packets_only_into_receive_and_event_chains_that_hold_them(
        rx_q in hostile::queue(rx_chain()),
        tx_q in hostile::queue(tx_chain()),
        event_q in hostile::queue(event_chain()),
        reset_pending: bool,
        host_connects: bool,
        host_bytes in vec(any::<u8>(), 0..300),
        host_hangs_up: bool,
        seed: u64,
    ) {
        let mem = hostile::guest_memory();
        hostile::fill(&mem, seed);
        let (rx, rx_layout) = rx_q.build(&mem, RX_QUEUE);
        let (tx, tx_layout) = tx_q.build(&mem, TX_QUEUE);
        let (event, event_layout) = event_q.build(&mem, EVENT_QUEUE);
        let rx_offered = hostile::offered(&mem, &rx_layout);
        let tx_offered = hostile::offered(&mem, &tx_layout);
        let event_offered = hostile::offered(&mem, &event_layout);

        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("v.sock");
        let listener = UnixListener::bind(&path).unwrap();
        listener.set_nonblocking(true).unwrap();
        let for_guest = UnixListener::bind(format!("{}_{LISTENED_PORT}", path.display())).unwrap();
        for_guest.set_nonblocking(true).unwrap();
        let mut host_streams = Vec::new();
        if host_connects {
            let mut s = UnixStream::connect(&path).unwrap();
            s.write_all(format!("CONNECT {GUEST_PORT}\n").as_bytes()).unwrap();
            s.write_all(&host_bytes).unwrap();
            host_streams.push(s);
        }
        let mut state = MuxerState::new(listener, path.clone());
        state.reset_pending = reset_pending;
        let metrics = Arc::new(VsockMetrics::default());
        let line = Arc::new(EventFd::new(libc::EFD_NONBLOCK).unwrap());
        let core = VsockCore::new(
            mem.clone(),
            Arc::new(VirtioInterrupt::new(line)),
            vec![rx, tx, event],
            (0..3).map(|_| EventFd::new(libc::EFD_NONBLOCK).unwrap()).collect(),
            CID,
            metrics.clone(),
            state,
            TimerFd::new().unwrap(),
        );
        let snapshot = Snapshot::take(&mem);

        let accepted = hostile::bounded(move || {
            let mut core = core;
            let ctl = WorkerCtl::for_test();
            core.on_start(&ctl);
            // The host side of what the guest opened answers with bytes (and maybe hangs
            // up); every stream the device watches then reports it is readable.
            let mut accepted = Vec::new();
            while let Ok((mut s, _)) = for_guest.accept() {
                let _ = s.write_all(&host_bytes);
                if !host_hangs_up {
                    accepted.push(s);
                }
            }
            for token in FIRST_STREAM_TOKEN..core.state.next_token {
                core.handle_event(&ctl, token, EventSet::IN | EventSet::OUT);
            }
            (core, accepted)
        });
        drop((accepted, host_streams));

        // Transmit chains are read, never written, and all returned.
        let tx_used = hostile::used(&mem, &tx_layout, &tx_offered)?;
        let returnable = tx_offered.iter().filter(|c| c.head < tx_layout.size).count();
        prop_assert_eq!(tx_used.len(), returnable, "a transmit chain was left on the ring");
        prop_assert!(tx_used.iter().all(|(len, _)| *len == 0), "a transmit chain reports written bytes");
        let m = metrics.snapshot();
        prop_assert_eq!(m.tx_packets + m.tx_errors, tx_offered.len() as u64, "every transmit chain is counted once");

        let mut allowed = ByteSet::default();
        for l in [&rx_layout, &tx_layout, &event_layout] {
            hostile::allow_used_ring(&mut allowed, l);
        }
        // A receive chain holds one whole packet (header and payload) or is returned empty.
        let rx_used = hostile::used(&mem, &rx_layout, &rx_offered)?;
        let written: Vec<Vec<(u64, u64)>> = rx_used
            .iter()
            .map(|(len, chain)| chain.writable_prefix(u64::from(*len)))
            .collect();
        for ((len, chain), ranges) in rx_used.iter().zip(&written) {
            if *len == 0 {
                continue;
            }
            prop_assert!(chain.well_formed(&mem, true, u64::from(u32::MAX)), "a packet went into a malformed chain {:?}", chain);
            prop_assert!(*len as usize >= HDR_LEN && u64::from(*len) <= chain.writable_len(), "used length {} for {:?}", len, chain);
            for &(addr, n) in ranges {
                allowed.insert(addr, n);
            }
        }
        // What the guest reads there is a packet from the host to it whose length field
        // matches the used length (checked where no later packet overwrote it).
        for (i, ((len, chain), ranges)) in rx_used.iter().zip(&written).enumerate() {
            let later: Vec<(u64, u64)> = written[i + 1..].iter().flatten().copied().collect();
            if *len == 0 || !hostile::disjoint(ranges) || hostile::overlap(ranges, &later) {
                continue;
            }
            let bytes = chain.writable_bytes(&mem, HDR_LEN as u64);
            let h = Header::parse(bytes[..HDR_LEN].try_into().unwrap());
            prop_assert_eq!((h.src_cid, h.dst_cid, h.type_), (HOST_CID, CID, TYPE_STREAM));
            prop_assert_eq!(h.len as usize, *len as usize - HDR_LEN, "header length of {:?}", h);
            prop_assert!((OP_REQUEST..=OP_CREDIT_REQUEST).contains(&h.op), "op of {:?}", h);
        }
        // The event queue carries one TRANSPORT_RESET, and only when one is pending.
        let event_used = hostile::used(&mem, &event_layout, &event_offered)?;
        prop_assert!(reset_pending || event_used.is_empty(), "an event chain was used with no event pending");
        let mut events = 0;
        for (len, chain) in &event_used {
            prop_assert!(*len == 0 || *len == 4, "event length {}", len);
            if *len == 4 {
                events += 1;
                prop_assert!(chain.well_formed(&mem, true, 4096) && chain.writable_len() >= 4, "an event went into {:?}", chain);
                for (addr, n) in chain.writable_prefix(4) {
                    allowed.insert(addr, n);
                }
            }
        }
        prop_assert!(events <= 1, "{} transport resets for one pending", events);
        snapshot.changes(&mem).check(&allowed, true)?;
    }
}
