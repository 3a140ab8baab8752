"""The accountable all-reduce of DiLoCo pseudo-gradients over hivemind, as one package with one vocabulary.

The unit is the *segment*: a fixed-size run of the flat vector of all parameters, encoded once by the run's codec.
A sender commits to its segments (a hotkey-signed Merkle root), each *owner* (a member that reduces a contiguous
range of segments) checks every segment against that root before it counts, averages it with the owner's rule and
sends the same bytes to every member, with a signed certificate and its claims (projections of the inputs it
averaged), which every member holds the average against before it counts, and each input's norm and largest
magnitude, from which each sender checks the claim of its own input; members compare certificates, and read each
other's disputes, after the round.

Modules, from the bottom up:

- :mod:`~template.allreduce.codecs` (built from :mod:`~template.allreduce.codec_base` and
  :mod:`~template.allreduce.sparse_codec`): segment codecs, bytes in, tensors out;
- :mod:`~template.allreduce.contribution`: a contribution encoded once, Merkle leaves, the signed commitment and
  per-segment statements;
- :mod:`~template.allreduce.messages`: the wire messages inside hivemind's ``AveragingData``;
- :mod:`~template.allreduce.reduction`: the owner's rule for one segment (also what validators recompute);
- :mod:`~template.allreduce.verification`: the owner's claims, and every member's check of each average against them;
- :mod:`~template.allreduce.disputes`: a sender's check of what an owner states of its own input, and its dispute;
- :mod:`~template.allreduce.segment_reducer`: an owner's segments, reduced as senders deliver them;
- :mod:`~template.allreduce.terms`: what a group's members agree on (layout, ranges, commitments, test faults);
- :mod:`~template.allreduce.evidence`: what a member saw, typed (read by the validator's audit);
- :mod:`~template.allreduce.owner_inputs`: what an owner accepted, kept and served for validators to recompute;
- :mod:`~template.allreduce.runner`: one group's all-reduce (streams, checks, certificates);
- :mod:`~template.allreduce.roster`: which groupmates take part in a group's all-reduce (absent, banned, served);
- :mod:`~template.allreduce.relay`: the shares a member holds, relayed to a groupmate that missed one;
- :mod:`~template.allreduce.averager_process`: hivemind's averager (matchmaking, its process) running our runner;
- :mod:`~template.allreduce.confirmation`: members compare owners' certificates, and read disputes, after the round;
- :mod:`~template.allreduce.averager`: the host-side facade, :class:`PseudoGradientAverager`.

hivemind's private members are used only through :mod:`template.p2p.hivemind_compat`. This file imports nothing,
so that the codec layer can be used without hivemind; the round imports the facade from its module.
"""
