"""The in-memory mock chain, driven through the real bittensor 11 SDK (no sockets).

Each check goes through ``bt.Subtensor("local", substrate=MockSubstrate())`` so the SDK's own reads, preflights and
intents decide what the mock must answer; state is compared as the JSON snapshot before and after every rejection.
"""

from __future__ import annotations

import asyncio
import json

import bittensor as bt
import pytest

from template.chain.mock import HISTORY_WINDOW, RAO_PER_TAO, MockSubstrate

NETUID = 1
TEMPO = 10
RATE_LIMIT = 5


@pytest.fixture(scope="module")
def wallets(tmp_path_factory):
    path = tmp_path_factory.mktemp("wallets")
    out = {}
    for name in ("validator", "miner1", "miner2", "miner3", "outsider"):
        wallet = bt.Wallet(name, "default", path=str(path))
        wallet.create_new_coldkey(use_password=False, overwrite=True, suppress=True)
        wallet.create_new_hotkey(use_password=False, overwrite=True, suppress=True)
        out[name] = wallet
    return out


def keys(wallet: bt.Wallet) -> tuple[str, str]:
    return wallet.hotkey.ss58_address, wallet.coldkeypub.ss58_address


def make_chain(wallets, **subnet_options) -> MockSubstrate:
    """Subnet 1: uid 0 the validator (1000 τ staked), uids 1-3 the miners (no stake)."""
    mock = MockSubstrate()
    options = {"weights_rate_limit": RATE_LIMIT, **subnet_options}
    mock.create_subnet(NETUID, TEMPO, name="diloco", **options)
    mock.register(NETUID, *keys(wallets["validator"]), stake_tao=1000.0)
    for name in ("miner1", "miner2", "miner3"):
        mock.register(NETUID, *keys(wallets[name]))
    return mock


@pytest.fixture
def mock(wallets):
    return make_chain(wallets)


@pytest.fixture
def sub(mock):
    client = bt.Subtensor("local", substrate=mock)
    yield client
    client.close()


def chain_view(mock: MockSubstrate) -> dict:
    """The state minus what any included extrinsic changes (nonces, the block's extrinsic counter)."""
    state = json.loads(mock.to_json())
    state.pop("nonces")
    state.pop("extrinsics_in_block")
    return state


def raw_weights(sub, wallet, dests, weights, version_key=0, netuid=NETUID):
    call = bt.calls.SubtensorModule.set_mechanism_weights(
        netuid=netuid, mecid=0, dests=dests, weights=weights, version_key=version_key
    )
    return sub.submit_call(call, wallet, signer="hotkey")


def test_metagraph_through_the_sdk_shows_registrations(sub, wallets):
    graph = sub.subnets.metagraph(NETUID)
    assert graph.name == "diloco" and graph.tempo == TEMPO and graph.block == 0
    assert graph.hotkeys == [wallets[n].hotkey.ss58_address for n in ("validator", "miner1", "miner2", "miner3")]
    assert graph.coldkeys == [wallets[n].coldkeypub.ss58_address for n in ("validator", "miner1", "miner2", "miner3")]
    validator = graph.neuron(0)
    assert validator.total_stake.rao == 1000 * RAO_PER_TAO
    assert [n.validator_permit for n in graph.neurons] == [True, False, False, False]
    assert [n.uid for n in graph.validators] == [0]
    assert graph.by_hotkey(wallets["miner2"].hotkey.ss58_address).uid == 2
    assert all(n.axon is None and n.active for n in graph.neurons)
    assert sub.subnets.metagraph(99) is None  # no such subnet


def test_subnet_owner_becomes_uid_zero(wallets):
    mock = MockSubstrate()
    mock.create_subnet(2, owner_hotkey=keys(wallets["outsider"])[0], owner_coldkey=keys(wallets["outsider"])[1])
    with bt.Subtensor("local", substrate=mock) as sub:
        graph = sub.subnets.metagraph(2)
    assert graph.owner_hotkey == keys(wallets["outsider"])[0]
    assert graph.owner_coldkey == keys(wallets["outsider"])[1]
    assert graph.hotkeys == [keys(wallets["outsider"])[0]]


def test_set_weights_reads_back_through_the_sdk(sub, mock, wallets):
    mock.advance_blocks(3)
    result = sub.execute(bt.SetWeights(netuid=NETUID, weights={1: 1.0, 2: 0.5}), wallets["validator"])
    assert result.success, result.message
    assert result.extrinsic_id == "3-0000"
    rows = sub.weights.weights(NETUID)
    assert list(rows) == [0]
    assert rows[0][1] == pytest.approx(2 / 3, abs=1e-4) and rows[0][2] == pytest.approx(1 / 3, abs=1e-4)
    assert sub.subnets.metagraph(NETUID).neuron(0).last_update == 3


def test_weights_from_an_unregistered_hotkey_are_refused(sub, mock, wallets):
    before = mock.to_json()
    with pytest.raises(bt.ChainError) as caught:
        sub.execute(bt.SetWeights(netuid=NETUID, weights={1: 1.0}), wallets["outsider"])
    assert caught.value.code is bt.ErrorCode.NOT_REGISTERED
    assert mock.to_json() == before
    result = raw_weights(sub, wallets["outsider"], [1], [65535])  # past the SDK's preflight, the chain refuses
    assert result.error.name == "HotKeyNotRegisteredInSubNet"
    assert result.error.code is bt.ErrorCode.NOT_REGISTERED


def test_weights_set_too_often_are_refused(sub, mock, wallets):
    mock.advance_blocks(1)
    assert sub.execute(bt.SetWeights(netuid=NETUID, weights={1: 1.0}), wallets["validator"]).success
    mock.advance_blocks(RATE_LIMIT - 1)
    before = chain_view(mock)
    with pytest.raises(bt.ChainError) as caught:
        sub.execute(bt.SetWeights(netuid=NETUID, weights={2: 1.0}), wallets["validator"])
    assert caught.value.code is bt.ErrorCode.RATE_LIMITED
    result = raw_weights(sub, wallets["validator"], [2], [65535])
    assert not result.success and result.error.name == "SettingWeightsTooFast"
    assert result.error.code is bt.ErrorCode.RATE_LIMITED
    assert chain_view(mock) == before
    mock.advance_blocks(1)  # now exactly rate_limit blocks later: allowed
    assert sub.execute(bt.SetWeights(netuid=NETUID, weights={2: 1.0}), wallets["validator"]).success


def test_version_key_below_the_subnets_is_refused(wallets):
    mock = make_chain(wallets, weights_version_key=5)
    with bt.Subtensor("local", substrate=mock) as sub:
        before = chain_view(mock)
        result = sub.execute(bt.SetWeights(netuid=NETUID, weights={1: 1.0}, version_key=4), wallets["validator"])
        assert not result.success
        assert result.error.name == "IncorrectWeightVersionKey"
        assert result.error.code is bt.ErrorCode.INVALID_ARGUMENT
        with pytest.raises(bt.ChainError):
            result.raise_for_failure()
        assert chain_view(mock) == before
        assert sub.execute(bt.SetWeights(netuid=NETUID, weights={1: 1.0}, version_key=5), wallets["validator"])


def test_fewer_weights_than_min_allowed_are_refused(wallets):
    mock = make_chain(wallets, min_allowed_weights=2)
    with bt.Subtensor("local", substrate=mock) as sub:
        before = chain_view(mock)
        with pytest.raises(bt.ChainError) as caught:  # the SDK preflights the count
            sub.execute(bt.SetWeights(netuid=NETUID, weights={1: 1.0}), wallets["validator"])
        assert caught.value.code is bt.ErrorCode.INVALID_ARGUMENT
        result = raw_weights(sub, wallets["validator"], [1], [65535])
        assert result.error.name == "WeightVecLengthIsLow"
        assert chain_view(mock) == before


@pytest.mark.parametrize(
    ("dests", "weights", "error_name"),
    [
        ([1, 9], [65535, 100], "UidVecContainInvalidOne"),
        ([1, 1], [65535, 100], "DuplicateUids"),
        ([1, 2], [65535], "WeightVecNotEqualSize"),
        ([0, 1, 2, 3, 1], [1, 1, 1, 1, 1], "UidsLengthExceedUidsInSubNet"),
    ],
)
def test_malformed_weight_vectors_are_refused_by_the_chain(sub, mock, wallets, dests, weights, error_name):
    before = chain_view(mock)
    result = raw_weights(sub, wallets["validator"], dests, weights)
    assert not result.success
    assert result.error.name == error_name
    assert result.error.code is not bt.ErrorCode.UNKNOWN
    assert chain_view(mock) == before
    assert sub.weights.weights(NETUID) == {}


def test_nonexistent_uid_through_the_intent_is_refused(sub, mock, wallets):
    before = chain_view(mock)
    result = sub.execute(bt.SetWeights(netuid=NETUID, weights={1: 1.0, 9: 1.0}), wallets["validator"])
    assert result.error.name == "UidVecContainInvalidOne"
    assert chain_view(mock) == before


def test_weights_without_a_validator_permit_are_refused(sub, mock, wallets):
    before = chain_view(mock)
    result = sub.execute(bt.SetWeights(netuid=NETUID, weights={2: 1.0}), wallets["miner1"])
    assert result.error.name == "NeuronNoValidatorPermit"
    assert chain_view(mock) == before
    assert sub.execute(bt.SetWeights(netuid=NETUID, weights={1: 1.0}), wallets["miner1"]).success  # self-weight


def test_an_epoch_turns_weights_into_incentive_dividends_and_emission(sub, mock, wallets):
    assert sub.execute(bt.SetWeights(netuid=NETUID, weights={1: 1.0, 2: 1.0}), wallets["validator"]).success
    assert sub.read("next_epoch_start_block", netuid=NETUID) == TEMPO
    mock.advance_blocks(TEMPO - 1)
    assert sub.subnets.metagraph(NETUID).neuron(1).incentive == 0.0  # not yet
    mock.advance_blocks(1)
    graph = sub.subnets.metagraph(NETUID)
    validator, miner1, miner2, miner3 = graph.neurons
    assert miner1.incentive > 0 and miner2.incentive > 0 and miner3.incentive == 0
    assert miner1.incentive == pytest.approx(miner2.incentive, abs=1e-4)
    assert validator.dividends > 0 and miner1.dividends == 0
    paid = sum(n.emission.rao for n in graph.neurons)
    assert paid == TEMPO * RAO_PER_TAO  # emission_per_block_rao x blocks since the last epoch
    assert miner1.emission.rao > 0 and miner3.emission.rao == 0
    assert miner1.total_stake.rao == miner1.emission.rao  # emission is added to stake
    assert validator.total_stake.rao == 1000 * RAO_PER_TAO + validator.emission.rao
    assert graph.last_step == TEMPO and graph.blocks_since_last_step == 0
    assert sub.read("next_epoch_start_block", netuid=NETUID) == 2 * TEMPO
    assert miner1.validator_permit and not miner3.validator_permit  # permits follow stake (non-zero, top-k)
    bonds = sub.read("bonds", netuid=NETUID)
    assert bonds[0][1] > 0 and bonds[0][2] > 0


def test_serve_axon_shows_in_the_metagraph(sub, mock, wallets):
    mock.advance_blocks(2)
    result = sub.execute(bt.ServeAxon(netuid=NETUID, ip="127.0.0.1", port=40123), wallets["miner1"])
    assert result.success, result.message
    assert sub.subnets.metagraph(NETUID).neuron(1).axon == "127.0.0.1:40123"
    axon = sub.query(("SubtensorModule", "Axons"), [NETUID, wallets["miner1"].hotkey.ss58_address])
    assert axon["ip"] == 0x7F000001 and axon["ip_type"] == 4 and axon["block"] == 2

    before = chain_view(mock)
    again = sub.execute(bt.ServeAxon(netuid=NETUID, ip="127.0.0.1", port=40124), wallets["miner1"])
    assert again.error.name == "ServingRateLimitExceeded"
    stranger = sub.execute(bt.ServeAxon(netuid=NETUID, ip="127.0.0.1", port=1), wallets["outsider"])
    assert stranger.error.name == "HotKeyNotRegisteredInNetwork"
    assert chain_view(mock) == before


def test_commitment_is_stored_and_read_back(sub, mock, wallets):
    call = bt.calls.Commitments.set_commitment(netuid=NETUID, info={"fields": [{"Raw11": b"peer:12D3Ko"}]})
    assert sub.submit_call(call, wallets["miner2"], signer="hotkey").success
    graph = sub.subnets.metagraph(NETUID)
    assert graph.commitments[2].value == "peer:12D3Ko"
    assert graph.neuron(2).commitment.block == 0
    record = sub.read("commitment", netuid=NETUID, hotkey_ss58=wallets["miner2"].hotkey.ss58_address)
    assert record.data == "peer:12D3Ko"

    before = chain_view(mock)
    refused = sub.submit_call(call, wallets["outsider"], signer="hotkey")
    assert refused.error.name == "AccountNotAllowedCommit"
    too_many = bt.calls.Commitments.set_commitment(netuid=NETUID, info={"fields": [{"Raw1": b"x"}] * 4})
    assert sub.submit_call(too_many, wallets["miner2"], signer="hotkey").error.name == "TooManyFieldsInCommitmentInfo"
    assert chain_view(mock) == before


def test_async_client_works_against_the_mock(mock, wallets):
    async def scenario():
        async with bt.Subtensor("local", substrate=mock) as client:
            result = await client.execute(bt.SetWeights(netuid=NETUID, weights={3: 1.0}), wallets["validator"])
            graph = await client.subnets.metagraph(NETUID)
            return result, graph, await client.block()

    result, graph, block = asyncio.run(scenario())
    assert result.success and len(graph) == 4 and block == 0


def test_json_snapshot_round_trips(sub, mock, wallets):
    assert sub.execute(bt.SetWeights(netuid=NETUID, weights={1: 1.0, 3: 0.25}), wallets["validator"]).success
    assert sub.execute(bt.ServeAxon(netuid=NETUID, ip="10.0.0.7", port=9000), wallets["miner3"]).success
    call = bt.calls.Commitments.set_commitment(netuid=NETUID, info={"fields": [{"Raw2": b"hi"}]})
    assert sub.submit_call(call, wallets["miner1"], signer="hotkey").success
    mock.advance_blocks(TEMPO + 3)

    restored = MockSubstrate.from_json(mock.to_json())
    assert restored.to_json() == mock.to_json()
    with bt.Subtensor("local", substrate=restored) as other:
        original, copy = sub.subnets.metagraph(NETUID), other.subnets.metagraph(NETUID)
        assert copy.raw == original.raw
        assert copy.commitments[1].value == "hi"
        # The copy keeps enforcing the same rules (nonces, rate limits) from the restored state.
        assert other.execute(bt.SetWeights(netuid=NETUID, weights={2: 1.0}), wallets["validator"]).success
    with pytest.raises(ValueError):
        MockSubstrate.from_json(json.dumps({"format": 999}))


def test_registration_rules(wallets):
    mock = MockSubstrate()
    mock.create_subnet(NETUID, tempo=2, max_uids=2, immunity_period=3)
    validator, miner1, miner2 = keys(wallets["validator"]), keys(wallets["miner1"]), keys(wallets["miner2"])
    assert mock.register(NETUID, *validator, stake_tao=10) == 0
    assert mock.register(NETUID, *miner1) == 1
    assert mock.register(NETUID, *miner1) == 1  # re-registering returns the same uid
    before = mock.to_json()
    with pytest.raises(bt.ChainError) as immune:
        mock.register(NETUID, *miner2)  # full, and both uids are still immune
    assert immune.value.name == "NoNeuronIdAvailable"
    with pytest.raises(bt.ChainError) as stolen:
        mock.register(NETUID, validator[0], miner2[1])  # someone else's hotkey
    assert stolen.value.name == "NonAssociatedColdKey"
    with pytest.raises(bt.ChainError) as missing:
        mock.register(42, *miner2)
    assert missing.value.name == "SubnetNotExists"
    assert mock.to_json() == before
    mock.advance_blocks(3)  # the epoch at block 2 pays the staked validator: miner1 has the lowest pruning score
    assert mock.register(NETUID, *miner2) == 1
    with bt.Subtensor("local", substrate=mock) as sub:
        assert sub.subnets.metagraph(NETUID).hotkeys == [validator[0], miner2[0]]
    with pytest.raises(ValueError):
        mock.create_subnet(0)
    with pytest.raises(bt.ChainError):
        mock.create_subnet(NETUID)


def test_blocks_hashes_and_clock(sub, mock):
    mock.advance_blocks(7)
    assert sub.block == 7 and sub.finalized_block == 7
    assert sub.block_time() == 12.0
    snapshot = sub.at(5)
    assert snapshot.block == 5 and len(snapshot.subnets.metagraph(NETUID)) == 4  # recent blocks: head state
    assert MockSubstrate().block_hash_sync(0) == mock.block_hash_sync(0)  # deterministic fake hashes
    assert mock.block_hash_sync(3) != mock.block_hash_sync(4)
    mock.advance_blocks(HISTORY_WINDOW + 1)
    with pytest.raises(bt.ChainError, match="keeps no history"):
        sub.subnets.metagraph(NETUID, block=5)
    with pytest.raises(bt.ChainError, match="no block at height"):
        asyncio.run(mock.block_hash(10_000))


def test_unsupported_items_raise_a_clear_chain_error(sub, mock, wallets):
    with pytest.raises(bt.ChainError, match="SubtensorModule.NotAnItem"):
        sub.query(("SubtensorModule", "NotAnItem"), [NETUID])
    with pytest.raises(bt.ChainError, match="NeuronInfoRuntimeApi.get_neurons_lite"):
        sub.runtime(("NeuronInfoRuntimeApi", "get_neurons_lite"), [NETUID])
    with pytest.raises(bt.ChainError, match="Balances.transfer_keep_alive"):
        sub.execute(bt.Transfer(dest_ss58=keys(wallets["miner1"])[1], amount_tao=1.0), wallets["validator"])
    with pytest.raises(bt.ChainError, match="takes keys"):
        sub.query(("SubtensorModule", "Tempo"), [NETUID, 2])


def test_explicit_nonces_are_checked(mock, wallets):
    hotkey = wallets["validator"].hotkey
    call = bt.calls.SubtensorModule.set_mechanism_weights(netuid=NETUID, mecid=0, dests=[1], weights=[1],
                                                           version_key=0)
    stale = mock.apply_extrinsic(call, hotkey.ss58_address, nonce=5)
    assert stale.error.name == "Future" and mock.account_next_index_sync(hotkey.ss58_address) == 0
    assert asyncio.run(mock.submit(call, hotkey, nonce=0)).success
    replay = mock.apply_extrinsic(call, hotkey.ss58_address, nonce=0)
    assert replay.error.name == "Stale"
