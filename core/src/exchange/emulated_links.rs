//! Emulated links: InfiniBand's rate and latency on NVLink hardware, so that the exchange's
//! schedules can be measured across "nodes" on one node (`LASP_EMULATE_LINKS`). The PEs form
//! nodes of `gpus_per_node` consecutive PEs; every LASP-2 summary tile a PE puts to another node
//! occupies that PE's emulated NIC for its bytes at the NIC's rate, after whatever it already
//! carries, and its signal arrives one latency after the transfer ends (the device side and what
//! it leaves out: `lasp2_link_emulation` in `lasp/exchange/chain_params.h`). Outputs do not
//! change: only when the readers see the signals does.

use crate::error::{Error, Result};
use cudarc::driver::{CudaSlice, CudaStream, DeviceRepr};
use lasp_shmem_kernels::params::lasp2_link_emulation;
use std::sync::Arc;
use std::time::Duration;

/// The variable that turns the emulation on, e.g. `gpus_per_node=1,latency_us=3,gb_per_s=25`.
pub const EMULATE_LINKS_VAR: &str = "LASP_EMULATE_LINKS";

/// The links between emulated nodes.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LinkEmulation {
    /// PEs per emulated node (consecutive PEs share one; transfers inside a node stay NVLink's).
    pub gpus_per_node: usize,
    /// Added to every transfer to another node.
    pub latency: Duration,
    /// One PE's NIC rate to other nodes, in bytes per second.
    pub bytes_per_second: f64,
}

impl LinkEmulation {
    /// Reads `gpus_per_node=G,latency_us=L,gb_per_s=R` (all three, any order; G a positive
    /// integer, L >= 0 and R > 0 decimals, R in 1e9 bytes per second).
    pub fn parse(text: &str) -> Result<Self> {
        let malformed = |why: &str| {
            Error::InvalidArgument(format!(
                "{EMULATE_LINKS_VAR}={text:?}: {why}; give all of gpus_per_node, latency_us and \
                 gb_per_s, e.g. {EMULATE_LINKS_VAR}=gpus_per_node=1,latency_us=3,gb_per_s=25 \
                 (one GPU per emulated node, 3 us per message, 25 GB/s per GPU), or unset it \
                 for the real links"
            ))
        };
        let (mut gpus, mut latency_us, mut gb_per_s) = (None, None, None);
        for item in text.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let (key, value) = item
                .split_once('=')
                .ok_or_else(|| malformed(&format!("{item:?} is not key=value")))?;
            let number = || {
                value
                    .trim()
                    .parse::<f64>()
                    .ok()
                    .filter(|v| v.is_finite())
                    .ok_or_else(|| malformed(&format!("{key} = {value:?} is not a number")))
            };
            match key.trim() {
                "gpus_per_node" => {
                    gpus = Some(
                        value
                            .trim()
                            .parse::<usize>()
                            .ok()
                            .filter(|&g| g > 0)
                            .ok_or_else(|| {
                                malformed(&format!(
                                    "gpus_per_node = {value:?} is not a positive integer"
                                ))
                            })?,
                    )
                }
                "latency_us" => latency_us = Some(number()?),
                "gb_per_s" => gb_per_s = Some(number()?),
                other => return Err(malformed(&format!("{other:?} is not a setting"))),
            }
        }
        let (Some(gpus_per_node), Some(latency_us), Some(gb_per_s)) = (gpus, latency_us, gb_per_s)
        else {
            return Err(malformed("a setting is missing"));
        };
        if latency_us < 0.0 || gb_per_s <= 0.0 {
            return Err(malformed("latency_us must be >= 0 and gb_per_s > 0"));
        }
        Ok(LinkEmulation {
            gpus_per_node,
            latency: Duration::from_secs_f64(latency_us * 1e-6),
            bytes_per_second: gb_per_s * 1e9,
        })
    }

    /// The variable as `get` reads it: `None` when unset.
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Option<Self>> {
        get(EMULATE_LINKS_VAR).map(|t| Self::parse(&t)).transpose()
    }

    /// How results name these links: "ib-emulated: 1 GPU per node, 3 us, 25 GB/s".
    pub fn label(&self) -> String {
        format!(
            "ib-emulated: {} GPU{} per node, {} us, {} GB/s",
            self.gpus_per_node,
            if self.gpus_per_node == 1 { "" } else { "s" },
            self.latency.as_secs_f64() * 1e6,
            self.bytes_per_second / 1e9
        )
    }

    /// The device struct, its NIC idle.
    fn device_struct(&self) -> lasp2_link_emulation {
        lasp2_link_emulation {
            free_at_ns: 0,
            latency_ns: self.latency.as_nanos() as u64,
            ps_per_byte: (1e12 / self.bytes_per_second).round().max(1.0) as u64,
            gpus_per_node: self.gpus_per_node.min(i32::MAX as usize) as i32,
            reserved: 0,
        }
    }
}

/// The device struct `lasp2_link_emulation`, for cudarc's copies.
#[repr(transparent)]
#[derive(Clone, Copy, Debug, Default)]
struct DeviceLinks(lasp2_link_emulation);

// SAFETY: the C struct of integers only, unchanged by the transparent wrapper: any bits are a
// valid value and copying them to the device is valid.
unsafe impl DeviceRepr for DeviceLinks {}

/// One exchange's emulated NIC in device memory (its clock advances with every held transfer).
pub(crate) struct EmulatedNic(CudaSlice<DeviceLinks>);

impl EmulatedNic {
    pub(crate) fn new(links: &LinkEmulation, stream: &Arc<CudaStream>) -> Result<Self> {
        Ok(EmulatedNic(
            stream.clone_htod(&[DeviceLinks(links.device_struct())])?,
        ))
    }

    /// Its device address, for the params' `link`.
    pub(crate) fn device_address(&self, stream: &CudaStream) -> u64 {
        use cudarc::driver::DevicePtr;
        self.0.device_ptr(stream).0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_setting_reads_in_any_order_and_names_what_is_wrong() {
        let links = LinkEmulation::parse("latency_us=3, gb_per_s=25,gpus_per_node=2").unwrap();
        assert_eq!(links.gpus_per_node, 2);
        assert_eq!(links.latency, Duration::from_micros(3));
        assert_eq!(links.bytes_per_second, 25e9);
        let d = links.device_struct();
        assert_eq!(
            (d.ps_per_byte, d.latency_ns, d.gpus_per_node),
            (40, 3000, 2)
        );
        assert_eq!(links.label(), "ib-emulated: 2 GPUs per node, 3 us, 25 GB/s");
        for (bad, says) in [
            ("gpus_per_node=1,latency_us=3", "missing"),
            (
                "gpus_per_node=0,latency_us=3,gb_per_s=25",
                "positive integer",
            ),
            ("gpus_per_node=1,latency_us=3,gb_per_s=0", "gb_per_s > 0"),
            ("gpus_per_node=1,latency_us=x,gb_per_s=25", "not a number"),
            (
                "gpus_per_node=1,latency_us=3,gb_per_s=25,mtu=4096",
                "not a setting",
            ),
            ("25GB/s", "not key=value"),
        ] {
            let msg = LinkEmulation::parse(bad).unwrap_err().to_string();
            assert!(
                msg.contains(says) && msg.contains(EMULATE_LINKS_VAR) && msg.contains("unset"),
                "{bad}: {msg}"
            );
        }
        assert_eq!(LinkEmulation::from_lookup(|_| None).unwrap(), None);
    }
}
