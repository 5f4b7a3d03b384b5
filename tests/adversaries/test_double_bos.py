"""A member that wants honest nodes' answers to deviate: it asks completions whose text begins with the
BOS token. A model node gave every completion its special tokens, so it read such a prompt with two BOS
tokens where every verifier reads one; its honest answers were scored in a context they were not
computed in (11 of 240 deviated at temperature 0.7, the worst at C = 0.29, twice of which untrusts a
node), and a member could grind salts for more. The node and the verifier now share the rule
(`models.prompts`): a real node reads the prompt with the ids the reference model scores it with."""

from __future__ import annotations

from modelnodes import complete, make_node, signed, view
from waiting import run

from planetserve.models import load
from planetserve.verifier.credibility import ReferenceModel


def test_a_completion_beginning_with_bos_is_read_as_the_verifier_reads_it(quick_family):
    reference = ReferenceModel.from_loaded(load("gt", quick_family), model_id="gt")
    bos = reference.tokenizer.bos_token
    prompts = [f"{bos}Why is the sky blue?", "Why is the sky blue?"]

    async def main():
        node = make_node(quick_family)
        await node.start()
        node.apply_view(view([node]))
        try:
            for prompt in prompts:
                answer = (await complete(node, prompt, max_tokens=12, temperature=0.7, seed=11)).json()
                assert answer["usage"]["prompt_tokens"] == len(reference.prompt_ids(prompt))
                response = signed(answer)
                verdict = reference.verify_one(response, prompt, node.keys.public)
                assert verdict.ok and verdict.deviations == 0, verdict.detail
        finally:
            await node.close()
            await node.engine.close()

    run(main())
