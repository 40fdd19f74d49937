//! The queues of a hostile driver against virtio-net: whatever the descriptors say, the
//! device sends exactly the frames of well-formed transmit chains, writes received frames
//! only into receive chains that take them, and reports exact lengths.
//!
//! The tap is one end of a datagram socket pair here (a frame per datagram, as a tap
//! passes them), so the tests need no network namespace.

use std::fs::File;
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixDatagram;

use proptest::collection::vec;
use proptest::prelude::*;

use super::*;
use crate::devices::virtio::hostile::{self, ByteSet, ChainGen, QueueGen, Snapshot};

fn net_core(mem: &GuestMemoryMmap, rx: Queue, tx: Queue) -> (NetCore, UnixDatagram) {
    let (ours, peer) = UnixDatagram::pair().unwrap();
    ours.set_nonblocking(true).unwrap();
    peer.set_nonblocking(true).unwrap();
    let tap = Tap::from_file(File::from(OwnedFd::from(ours)), "hostile0");
    let line = Arc::new(EventFd::new(libc::EFD_NONBLOCK).unwrap());
    let core = NetCore {
        mem: mem.clone(),
        interrupt: Arc::new(VirtioInterrupt::new(line)),
        rx,
        tx,
        tap: Arc::new(tap),
        metrics: Arc::new(NetMetrics::default()),
        queue_events: (0..2)
            .map(|_| EventFd::new(libc::EFD_NONBLOCK).unwrap())
            .collect(),
        rx_frame: RxFrame::new(),
        tx_buf: Vec::new(),
        tx_blocked: false,
    };
    (core, peer)
}

fn tx_chain() -> BoxedStrategy<ChainGen> {
    let len = prop_oneof![
        2 => Just(VNET_HDR_LEN as u32),
        3 => 14u32..1600,
        1 => Just((MAX_CHAIN_LEN - VNET_HDR_LEN) as u32),
        1 => hostile::any_len(),
    ];
    let bufs = vec(hostile::buf(hostile::data_addr(), len.boxed(), 0.05), 1..=4);
    hostile::mostly_plain(bufs.boxed(), 0.2)
}

fn rx_chain() -> BoxedStrategy<ChainGen> {
    let len = prop_oneof![
        2 => Just((VNET_HDR_LEN + 1514) as u32),
        1 => Just(MAX_CHAIN_LEN as u32),
        2 => 0u32..2000,
        1 => hostile::any_len(),
    ];
    let bufs = vec(hostile::buf(hostile::data_addr(), len.boxed(), 0.95), 1..=3);
    hostile::mostly_plain(bufs.boxed(), 0.9)
}

proptest! {
    #![proptest_config(hostile::config())]

    #[test]
    fn net_transmits_exactly_the_frames_of_well_formed_chains_and_writes_only_the_used_ring(
        q in hostile::queue(tx_chain()),
        seed: u64,
    ) {
        let mem = hostile::guest_memory();
        hostile::fill(&mem, seed);
        let (rx, _) = QueueGen::idle().build(&mem, RX_QUEUE);
        let (tx, layout) = q.build(&mem, TX_QUEUE);
        let offered = hostile::offered(&mem, &layout);
        // A chain that reads the used ring (a hostile driver may) sends what the ring holds
        // when it goes out: its bytes are only known beforehand for other chains.
        let used_ring = [layout.used_ring_bytes()];
        let want: Vec<(Vec<u8>, bool)> = offered
            .iter()
            .filter(|c| c.well_formed(&mem, false, MAX_CHAIN_LEN as u64))
            .filter(|c| c.readable_len() >= VNET_HDR_LEN as u64)
            .map(|c| {
                let ranges: Vec<(u64, u64)> = c.descs.iter().map(|d| (d.addr, u64::from(d.len))).collect();
                (c.readable_bytes(&mem), !hostile::overlap(&ranges, &used_ring))
            })
            .collect();
        let snapshot = Snapshot::take(&mem);
        let (core, peer) = net_core(&mem, rx, tx);

        let (core, sent) = hostile::bounded(move || {
            let mut core = core;
            let mut sent = Vec::new();
            let mut buf = vec![0u8; MAX_CHAIN_LEN + 1];
            let mut take_frames = |sent: &mut Vec<Vec<u8>>| {
                while let Ok(n) = peer.recv(&mut buf) {
                    sent.push(buf[..n].to_vec());
                }
            };
            // As the worker does: a full tap queue holds the rest back until it drains.
            let mut blocked = core.run_tx();
            let mut rounds = 0;
            while blocked {
                rounds += 1;
                assert!(rounds <= 1000, "transmit makes no progress while the tap drains");
                take_frames(&mut sent);
                blocked = core.run_tx();
            }
            take_frames(&mut sent);
            (core, sent)
        });

        prop_assert_eq!(sent.len(), want.len(), "frames sent");
        for (i, (got, (want, known))) in sent.iter().zip(&want).enumerate() {
            prop_assert_eq!(got.len(), want.len(), "length of frame {}", i);
            prop_assert!(!known || got == want, "frame {} differs from its chain's bytes", i);
        }
        let used = hostile::used(&mem, &layout, &offered)?;
        let returnable = offered.iter().filter(|c| c.head < layout.size).count();
        prop_assert_eq!(used.len(), returnable, "a transmit chain was left on the ring");
        prop_assert!(used.iter().all(|(len, _)| *len == 0), "a transmit chain reports written bytes");
        let mut allowed = ByteSet::default();
        hostile::allow_used_ring(&mut allowed, &layout);
        snapshot.changes(&mem).check(&allowed, true)?;
        let m = core.metrics.snapshot();
        prop_assert_eq!(m.tx_packets, want.len() as u64);
        prop_assert_eq!(m.tx_errors + m.tx_packets, offered.len() as u64, "every chain is counted once");
    }

    #[test]
    fn net_receives_frames_only_into_writable_chains_that_fit_and_reports_their_exact_length(
        q in hostile::queue(rx_chain()),
        frames in vec(prop_oneof![
            4 => 12usize..1600,
            1 => Just(VNET_HDR_LEN),
            1 => Just(MAX_CHAIN_LEN),
            1 => 1600..MAX_CHAIN_LEN,
            1 => 0..VNET_HDR_LEN,
        ], 0..8),
        seed: u64,
    ) {
        let mem = hostile::guest_memory();
        hostile::fill(&mem, seed);
        let (rx, layout) = q.build(&mem, RX_QUEUE);
        let (tx, _) = QueueGen::idle().build(&mem, TX_QUEUE);
        let offered = hostile::offered(&mem, &layout);
        let snapshot = Snapshot::take(&mem);
        let (core, peer) = net_core(&mem, rx, tx);
        let mut queued: Vec<Vec<u8>> = Vec::new();
        for (i, &n) in frames.iter().enumerate() {
            let frame: Vec<u8> = (0..n).map(|k| (k * 31 + i * 7) as u8).collect();
            if peer.send(&frame).is_err() {
                break;
            }
            queued.push(frame);
        }

        let core = hostile::bounded(move || {
            let mut core = core;
            core.run_rx();
            core
        });

        // The device's loop, as the virtio-net documentation states it: a frame is read
        // only when it can be placed; a malformed chain is returned empty and the frame
        // waits for the next; a chain too small for the frame is returned empty and the
        // frame dropped; a read shorter than the header ends the pass.
        let mut frames_left = queued.iter();
        let mut pending: Option<&Vec<u8>> = None;
        let mut chains_left = offered.iter();
        let mut want: Vec<(u32, Option<&Vec<u8>>)> = Vec::new();
        let (mut delivered, mut dropped) = (0, 0);
        loop {
            let frame = match pending.take() {
                Some(f) => f,
                None => match frames_left.next() {
                    Some(f) if f.len() >= VNET_HDR_LEN => f,
                    _ => break,
                },
            };
            let Some(chain) = chains_left.next() else {
                break;
            };
            let returned = chain.head < layout.size;
            if !chain.well_formed(&mem, true, u64::from(u32::MAX)) {
                pending = Some(frame);
                if returned {
                    want.push((0, None));
                }
            } else if chain.writable_len() < frame.len() as u64 {
                dropped += 1;
                want.push((0, None));
            } else {
                delivered += 1;
                want.push((frame.len() as u32, Some(frame)));
            }
        }
        let used = hostile::used(&mem, &layout, &offered)?;
        let got: Vec<u32> = used.iter().map(|(len, _)| *len).collect();
        let lens: Vec<u32> = want.iter().map(|(len, _)| *len).collect();
        prop_assert_eq!(got, lens, "used lengths");

        let mut allowed = ByteSet::default();
        hostile::allow_used_ring(&mut allowed, &layout);
        let written: Vec<Vec<(u64, u64)>> = used
            .iter()
            .map(|(len, chain)| chain.writable_prefix(u64::from(*len)))
            .collect();
        for ranges in &written {
            for &(addr, n) in ranges {
                allowed.insert(addr, n);
            }
        }
        snapshot.changes(&mem).check(&allowed, true)?;
        // Each frame arrived whole (num_buffers set to 1), where no later write covers it.
        for (i, ((_, chain), (len, frame))) in used.iter().zip(&want).enumerate() {
            let Some(frame) = frame else { continue };
            let others: Vec<(u64, u64)> = written[i + 1..].iter().flatten().copied().collect();
            if !hostile::disjoint(&written[i]) || hostile::overlap(&written[i], &others) {
                continue;
            }
            let mut expect = frame.to_vec();
            expect[10..12].copy_from_slice(&1u16.to_le_bytes());
            prop_assert!(chain.writable_bytes(&mem, u64::from(*len)) == expect, "received frame {} is not what the tap gave", i);
        }
        let m = core.metrics.snapshot();
        prop_assert_eq!((m.rx_packets, m.rx_dropped), (delivered, dropped));
    }
}
