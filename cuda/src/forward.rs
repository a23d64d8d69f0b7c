//! One forward's layout on the device ([`CudaBatch`]; `Tok` and `RowKv` in forward.cuh):
//! its tokens, the rows' K/V layouts and block tables, and the tensor-core attention's tiles.

use cudarc::driver::CudaSlice;
use mtp_base::error::{Error, Result};
use mtp_kernels::{KvDtype, Plane};

use crate::{flash, ptr, Cuda, CudaKv};

/// Fields of a row's K/V layout (`RowKv` in forward.cuh).
pub(crate) const ROW_FIELDS: usize = 7;

// The kernels' block (KV_BLOCK in forward.cuh) is the cache's.
const _: () = assert!(mtp_cache::BLOCK_POSITIONS == 64);

/// One forward's layout on the device (see `Tok` and `RowKv` in forward.cuh).
pub struct CudaBatch {
    pub(crate) toks: CudaSlice<i32>,
    pub(crate) rows: CudaSlice<i64>,
    /// The rows' sliding-window rings, when every row has one.
    pub(crate) ring_rows: Option<CudaSlice<i64>>,
    /// The rows' block tables (pool indices), which `rows` and `ring_rows` point into: held
    /// until the forward's kernels are queued.
    pub(crate) _tables: CudaSlice<i32>,
    /// Each token's id.
    pub(crate) tokens: CudaSlice<u32>,
    pub(crate) m: usize,
    /// The most keys a token reads (position + 1).
    pub(crate) most_keys: usize,
    pub(crate) kv: KvDtype,
    /// Key segments per query: 1, except under the split-attention negative control.
    pub(crate) splits: i32,
    /// The tokens cut into the tensor-core attention's tiles.
    pub(crate) tiles: flash::FlashTiles,
    /// Where adjacent rows hold the same leading blocks: the tiles that read them once for
    /// all (the main store's full-attention layers with the tensor-core attention).
    pub(crate) shared: Option<flash::SharedTiles>,
}

impl Cuda {
    /// The rows' K/V layouts for the kernels (`RowKv` in forward.cuh, [`ROW_FIELDS`] each)
    /// and their rings', with every block table uploaded in one buffer they point into.
    #[allow(clippy::type_complexity)]
    pub(crate) fn row_layouts(
        &self,
        stores: &[(&CudaKv, mtp_cache::SlotMap)],
        rings: &[(&CudaKv, mtp_cache::SlotMap)],
    ) -> Result<(Vec<i64>, Vec<i64>, CudaSlice<i32>)> {
        let mut indices: Vec<i32> = Vec::new();
        let mut starts = Vec::with_capacity(stores.len() + rings.len());
        for (store, _) in stores.iter().chain(rings) {
            starts.push(indices.len());
            indices.extend(store.table());
        }
        let tables = self.upload_as(&indices, "block tables")?;
        let at = ptr(&tables, &self.stream) as i64;
        let layout = |(store, map): &(&CudaKv, mtp_cache::SlotMap), start: usize| {
            [
                store.base(),
                store.plane() as i64,
                map.committed as i64,
                map.base as i64,
                map.ring as i64,
                at + 4 * start as i64,
                store.block_slots() as i64,
            ]
        };
        let rows = stores.iter().zip(&starts).flat_map(|(s, &i)| layout(s, i)).collect();
        let ring_rows = rings.iter().zip(&starts[stores.len()..]).flat_map(|(s, &i)| layout(s, i)).collect();
        Ok((rows, ring_rows, tables))
    }

    /// The tensor-core attention's tiles of a batch whose tokens sit in `rows`.
    pub(crate) fn flash_tiles(&self, rows: &[usize]) -> Result<flash::FlashTiles> {
        self.tiles_on_device(flash::tiles(rows).0, "batch layout")
    }

    /// Tile quads ([`flash::FlashTiles`]) on the device.
    pub(crate) fn tiles_on_device(&self, quads: Vec<i32>, what: &str) -> Result<flash::FlashTiles> {
        let most = quads.chunks(4).map(|q| q[1] as usize).max().unwrap_or(0);
        Ok(flash::FlashTiles { buf: self.upload_as(&quads, what)?, count: quads.len() / 4, most })
    }

    /// The row layout of `plane` and the layer within it.
    pub(crate) fn plane_rows<'a>(
        &self,
        batch: &'a CudaBatch,
        plane: Plane,
    ) -> Result<(&'a CudaSlice<i64>, i32)> {
        match plane {
            Plane::Main(l) => Ok((&batch.rows, l as i32)),
            Plane::Ring(l) => match &batch.ring_rows {
                Some(rows) => Ok((rows, l as i32)),
                None => Err(Error::Backend("a sliding-window layer ran over rows without a ring".into())),
            },
        }
    }
}
