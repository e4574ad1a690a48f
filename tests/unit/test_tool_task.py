"""The calculator task (lorarl.assets.tool_task): fixed disjoint splits, the tool and the agent's slips, and
pretraining conversations that are token for token what an episode on the OpenAI-compatible endpoint is
(the turns the policy samples, the tool's reply as the endpoint appends it), labelled on the policy's turns."""

from __future__ import annotations

from lorarl.assets.paths import TOKENIZER_DIR
from lorarl.assets.pretrain import IGNORE_INDEX, encode_conversation
from lorarl.assets.tokenizer import EOS_TOKEN_ID, default_tokenizer
from lorarl.assets.tool_task import (
    TOOLS,
    ToolProblem,
    build_splits,
    calculate,
    conversation,
    final_answer,
    load_tool_split,
    misread,
    shortcut_guess,
    tool_reward,
)
from lorarl.client.workflow.api import Episode, Sampled
from lorarl.contract.chat import ChatRenderer


def test_splits_are_fixed_disjoint_and_shipped() -> None:
    splits = build_splits()
    assert len(splits["train"]) == 6000 and len(splits["test"]) == 200
    assert not {p.prompt for p in splits["train"]} & {p.prompt for p in splits["test"]}
    assert load_tool_split("test") == splits["test"] and load_tool_split("train")[:50] == splits["train"][:50]
    assert all(p.answer == calculate(p.expr) for p in splits["test"])


def test_the_tool_and_the_slips() -> None:
    problem = ToolProblem("286*48=", "13728")
    assert calculate("286*48") == "13728" and calculate(" 286 * 48 ") == "13728"
    assert calculate("286+48").startswith("error") and calculate("").startswith("error")
    assert shortcut_guess(problem) == str(286 * 40) and misread("13728") == "13782" and misread("11") == "11"
    assert final_answer(" 13728<|im_end|>") == "13728" and final_answer("the answer is 5") is None
    assert tool_reward("13728", "13728") == 1.0 and tool_reward("13782", 13728) == 0.0


def test_pretraining_conversations_are_the_tokens_of_an_endpoint_episode() -> None:
    tokenizer = default_tokenizer()
    renderer = ChatRenderer(str(TOKENIZER_DIR))
    problem = ToolProblem("286*48=", "13728")
    ids, labels = encode_conversation(tokenizer, conversation(problem, "gold"), TOOLS)
    text = '<tool_call>\n{"name": "calc", "arguments": {"expr": "286*48"}}\n</tool_call>'
    call = [*tokenizer.encode(text, add_special_tokens=False), EOS_TOKEN_ID]
    answer = [*tokenizer.encode("13728", add_special_tokens=False), EOS_TOKEN_ID]
    # what the endpoint builds: the prompt, the sampled call, its glue and the tool's reply, the sampled answer
    prompt = renderer.render([{"role": "user", "content": problem.prompt}], tools=TOOLS)
    reply = renderer.render_followup([{"role": "tool", "tool_call_id": "c", "content": "13728"}], tools=TOOLS)
    episode = Episode(prompt)
    episode.add_policy(Sampled(call, [0.0] * len(call), [0] * len(call)))
    episode.add_context(reply)
    episode.add_policy(Sampled(answer, [0.0] * len(answer), [0] * len(answer)))
    assert ids[: len(episode.token_ids)] == episode.token_ids and len(ids) == len(episode.token_ids) + 1  # + "\n"
    trained = [i for i, label in zip(ids, labels, strict=True) if label != IGNORE_INDEX]
    assert trained == call + answer == [t for t, m in zip(episode.completion_ids, episode.loss_mask, strict=True) if m]
    assert episode.policy_turns() == [call, answer]
    skipped, skipped_labels = encode_conversation(tokenizer, conversation(problem, "skip"), TOOLS)
    assert [i for i, label in zip(skipped, skipped_labels, strict=True) if label != IGNORE_INDEX] == \
        [*tokenizer.encode(str(286 * 40), add_special_tokens=False), EOS_TOKEN_ID]


def test_the_mixed_teacher_serves_whole_batches_of_one_kind_tools_every_fourth() -> None:
    """qwen3-tiny-mixed's teacher: a tool batch every `tool_every` calls, the single-turn tasks otherwise, each
    padded to its own width (a tool conversation is many times a task's length)."""
    import random

    from lorarl.assets.pretrain import MixedTeacher
    from lorarl.assets.tasks import load_split

    tools, tasks = load_tool_split("train")[:8], load_split("train")[:8]
    teacher = MixedTeacher([*tools, *tasks], default_tokenizer())
    assert [len(t.problems) for t in teacher.teachers] == [8, 8] and MixedTeacher.tool_every == 4
    rng = random.Random(0)
    widths = [teacher.batch(list(range(i, i + 4)), 0.0, rng)[0].shape for i in range(8)]
    assert all(shape[0] == 4 for shape in widths)
    tool_calls = [widths[i][1] for i in (0, 4)]
    task_calls = [w[1] for i, w in enumerate(widths) if i not in (0, 4)]
    assert min(tool_calls) > 3 * max(task_calls), widths
