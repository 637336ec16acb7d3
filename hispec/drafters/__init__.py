"""What proposes tokens for the model to verify: the drafters a decoding level can be (design.md §2, §4).

- `heads`: exit heads (`shared`, `norm`, `linear`, `lowrank`, `layer`, `context`) that read the model's own
  residual stream after layer k and reuse its lm_head: the `L<k>` levels of a hierarchy.
- `eagle3`: the EAGLE-3 drafter, one decoder layer over the target's fused aux-layer states: the `eagle3` level.
- `ngram`: prompt lookup over a row's own prompt and output, no model cost: the `ngram` level.

How a level drafts in a round (chains, static and dynamic trees) is `hispec.decoding`'s. Nothing is imported here,
so `hispec.drafters.ngram` stays free of the model code.
"""
