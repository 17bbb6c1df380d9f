"""Rule vocab_map: argument plumbing for eagleflow.train.vocab.build_vocab_map."""

from eagleflow.stage import stage
from eagleflow.train.vocab import build_vocab_map

with stage(snakemake) as sm:
    build_vocab_map(
        sm.input.token_freq,
        sm.params.draft_vocab_size,
        sm.output.d2t,
        sm.output.t2d,
        sm.input.target,
        init_from=sm.params.init_from,
    )
