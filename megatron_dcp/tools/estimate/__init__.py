"""``megatron-dcp estimate``: "should I use DCP on my data?" answered from the data's sequence
lengths and the model's flags before any GPU time is spent: the data's global batches
(``sources``), planned by static CP, DCP and Megatron dev's planner under the model's cost model
(``arm_plans``), each plan's step time with the part of a step no plan changes (``step_rest``),
and the verdict (``answer``). See docs/estimate.md."""
